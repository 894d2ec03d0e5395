"""The Triton kernels of ``ops.causal_conv`` (``kernels.py`` imports triton; nothing here does)."""
