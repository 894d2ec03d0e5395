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

from .backend import (
    SUPPORTED_BACKENDS,
    EagerBackend,
    GDNBackend,
    GDNKernelOptions,
    TritonBackend,
    chunk_gated_delta_rule,
    get_backend,
    validate_inputs,
)
from .chunk import PreparedChunks, chunk_output, prepare_chunks
from .reference import l2norm, recurrent_gated_delta_rule
from .summary import (
    apply_summary,
    apply_summary_backward,
    chunk_transitions,
    compose,
    output_state_grad,
    state_summary,
    summarize,
    tree_compose,
)

__all__ = [
    "SUPPORTED_BACKENDS",
    "EagerBackend",
    "GDNBackend",
    "GDNKernelOptions",
    "PreparedChunks",
    "TritonBackend",
    "apply_summary",
    "apply_summary_backward",
    "chunk_gated_delta_rule",
    "chunk_output",
    "chunk_transitions",
    "compose",
    "get_backend",
    "l2norm",
    "output_state_grad",
    "prepare_chunks",
    "recurrent_gated_delta_rule",
    "state_summary",
    "summarize",
    "tree_compose",
    "validate_inputs",
]
