"""The hooks by which a GDN kernel's entering and leaving states cross to other ranks.

No triton here: context-parallel code subclasses :class:`StateLink` without importing the
kernels. ``overlap_runtime.ops.gdn.triton.function.gdn_forward`` / ``gdn_backward`` call it, and
so does the eager local backend of ``context_parallel.gdn.state_passing`` (one segment per row:
the shard's own summary), so one link drives either backend.
"""

from __future__ import annotations

import torch


class StateLink:
    """Where the state entering a sequence comes from and where the state leaving it goes, when
    they cross to another rank (context parallelism). The default links nothing: the entering
    state is the op's ``initial_state`` argument and the final state is only returned.

    The cores call the hooks at the earliest point the algebra allows:

    * forward: (:meth:`segment_maps`, then) :meth:`entering_state` after the segment summaries (the wait sits there, after
      everything that does not need the state), :meth:`leaving_state` right after the chain
      across segments (before the per-segment scans and the outputs);
    * backward: (:meth:`segment_state_grads`, then) :meth:`leaving_state_grad` after ``dv_local`` and the segment-local
      reverse scans; :meth:`entering_state_grad` right after the reverse chain (before the
      per-chunk reverse scan and every input-gradient kernel).

    Per-call state (requests in flight) belongs on the instance the caller builds for one call.
    """

    #: The hooks need the segment summaries to run early: at least this many segments.
    min_segments: int = 1
    #: Hand the segment maps to :meth:`segment_maps` / :meth:`segment_state_grads` (the op then
    #: computes them even for one segment).
    wants_segment_maps: bool = False
    #: Whether anything of this call leaves through the link: the forward's leaving state or
    #: segment maps, the backward's entering-state gradient or segment state gradients. False:
    #: a backend that forms them only for the link may skip them (the Triton op forms them for
    #: its own chain anyway and calls the hooks regardless).
    leaves: bool = True

    def segment_maps(self, m_seg: torch.Tensor, s_seg: torch.Tensor) -> None:
        """Forward, right before :meth:`entering_state` (only if ``wants_segment_maps``): the
        segment summaries from zero, ``M [B*HV, NS, K, K]`` and ``S [B*HV, NS, K, V]`` fp32, in
        time order (``h_(s+1) = M_s h_s + S_s``)."""

    def segment_state_grads(self, m_seg: torch.Tensor, local: torch.Tensor) -> None:
        """Backward, right before :meth:`leaving_state_grad` (only if ``wants_segment_maps``):
        the segment maps ``M [B*HV, NS, K, K]`` and the segment-local state gradients ``c_s
        [B*HV, NS, K, V]`` fp32 (``dh_s = M_s^T dh_(s+1) + c_s``)."""

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
