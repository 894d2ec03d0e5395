"""The Triton kernels of ``ops.causal_conv`` (``kernels.py`` imports triton; nothing here does).

May import: torch and triton (``kernels.py`` only), as its parent ``ops.causal_conv`` says.
"""
