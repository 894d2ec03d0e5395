"""Operators: the floor of the package, communication and kernels that know no model.

=================  ===========================================================================
``comm``           package: differentiable collectives with bounded waits and the one
                   point-to-point layer (``isend``, ``irecv``, ``ring_shift``); the only place
                   that turns a group rank into a global rank
``comm_stats``     :class:`~overlap_runtime.ops.comm_stats.CommStats`, the per-call record of
                   the communication a context-parallel call issued
``gdn``            package: Gated DeltaNet math (recurrent reference, chunked eager form, affine
                   state summaries) and its backends (eager, Triton kernels in ``gdn/triton``)
``causal_conv``    package: the GDN layer's causal depthwise conv + SiLU as Triton kernels
                   (forward, dx / dweight / halo gradients, document starts masked)
``attention``      local attention blocks returning ``(out, lse)``; the online-softmax merge
=================  ===========================================================================

May import: torch, ``overlap_runtime.platform`` and ``overlap_runtime._lazy`` (and, lazily,
triton); nothing else of the package: every other package builds on this one. Nothing is
re-exported here: import the subpackage or module (``from overlap_runtime.ops import comm``).
"""
