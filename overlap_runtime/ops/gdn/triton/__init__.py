"""Triton kernels of the GDN backend (``backend="triton"``); see docs/gdn.md.

Importing this package imports no triton: the names below load their module (and triton) on
first use, so ``TRITON_INTERPRET`` can still be set before that.

* ``chunk_gated_delta_rule_triton``, ``TritonChunkGatedDeltaRuleFunction`` (function.py):
  the fused chunked forward/backward (its kernel launchers: launch.py).
* ``state_summary``, ``output_state_grad``, ``apply_summary``, ``apply_summary_backward``,
  ``compose`` (summary.py): the context-parallel state-summary kernels, with the signatures
  of their eager counterparts in ``overlap_runtime.ops.gdn.summary`` (forward only).
* ``check_triton_inputs`` (capability.py): the capability rules, no triton needed.
"""

from __future__ import annotations

from ...._lazy import lazy_exports

_WHERE = {
    "TritonChunkGatedDeltaRuleFunction": "function",
    "chunk_gated_delta_rule_triton": "function",
    "apply_summary": "summary",
    "apply_summary_backward": "summary",
    "compose": "summary",
    "output_state_grad": "summary",
    "state_summary": "summary",
    "check_triton_inputs": "capability",
}


__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
