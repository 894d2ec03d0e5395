"""Gated DeltaNet core: recurrent reference, chunked eager form, affine state summaries, backends.

The math of one GDN layer's sequence recurrence on one device, for ``layers.GatedDeltaNet`` and
for GDN context parallelism (``context_parallel.gdn``), which hand states across ranks through
the ``state_link`` hooks. ``backend="eager" | "triton"`` (no auto); the Triton kernels live in
``triton/`` and load triton only on first use. See docs/gdn.md for the semantics, the chunked WY
form and the summary algebra. ``fla_compat.chunk_gated_delta_rule`` is a drop-in for
flash-linear-attention 0.6.0's function of that name (its signature and defaults).

May import: torch, ``overlap_runtime._lazy`` and (in ``triton/``, lazily) triton; nothing else
of ``overlap_runtime``: no communication, no layers.
"""

from ..._lazy import lazy_exports

# loaded on first use: ``ops.gdn.options`` (the configuration floor reads it) must not pull in
# torch and the kernels
_EXPORTS: dict[str, str] = {
    "SUPPORTED_BACKENDS": "backend",
    "EagerBackend": "backend",
    "GDNBackend": "backend",
    "GDNKernelOptions": "backend",
    "TritonBackend": "backend",
    "chunk_gated_delta_rule": "backend",
    "get_backend": "backend",
    "validate_inputs": "backend",
    "PreparedChunks": "chunk",
    "chunk_output": "chunk",
    "prepare_chunks": "chunk",
    "l2norm": "reference",
    "recurrent_gated_delta_rule": "reference",
    "apply_summary": "summary",
    "apply_summary_backward": "summary",
    "chunk_transitions": "summary",
    "compose": "summary",
    "output_state_grad": "summary",
    "state_summary": "summary",
    "summarize": "summary",
    "tree_compose": "summary",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
del lazy_exports  # the package lists its names only (``dir`` is ``__all__``)
