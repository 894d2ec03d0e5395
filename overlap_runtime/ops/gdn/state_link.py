"""The hooks by which a GDN kernel's entering and leaving states cross to other ranks.

No triton here: context-parallel code subclasses :class:`StateLink` without importing the
kernels. ``overlap_runtime.ops.gdn.triton.function.gdn_forward`` / ``gdn_backward`` call it.
"""

from __future__ import annotations

import torch

__all__ = ["StateLink"]


class StateLink:
    """Where the state entering a sequence comes from and where the state leaving it goes, when
    they cross to another rank (context parallelism). The default links nothing: the entering
    state is the op's ``initial_state`` argument and the final state is only returned.

    The cores call the hooks at the earliest point the algebra allows:

    * forward: :meth:`entering_state` after the segment summaries (the wait sits there, after
      everything that does not need the state), :meth:`leaving_state` right after the chain
      across segments (before the per-segment scans and the outputs);
    * backward: :meth:`leaving_state_grad` after ``dv_local`` and the segment-local
      reverse scans; :meth:`entering_state_grad` right after the reverse chain (before the
      per-chunk reverse scan and every input-gradient kernel).

    Per-call state (requests in flight) belongs on the instance the caller builds for one call.
    """

    #: The hooks need the segment summaries to run early: at least this many segments.
    min_segments: int = 1

    def entering_state(self) -> torch.Tensor | None:
        """``[B, HV, K, V]`` fp32 state entering the sequence, or None (zeros)."""
        return None

    def leaving_state(self, h_out: torch.Tensor) -> None:
        """Receives the final state ``[B, HV, K, V]`` fp32 as soon as it is known."""

    def leaving_state_grad(self) -> torch.Tensor | None:
        """``[B, HV, K, V]`` fp32 gradient of the final state from outside, or None (zeros)."""
        return None

    def entering_state_grad(self, dh_in: torch.Tensor) -> None:
        """Receives the gradient of the entering state ``[B, HV, K, V]`` fp32 when known."""
