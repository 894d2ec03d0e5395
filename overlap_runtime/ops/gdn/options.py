"""Tuning options of the GDN backends, one validated argument of ``chunk_gated_delta_rule``.

:class:`GDNKernelOptions` is a frozen dataclass; every field is None ("the backend's default")
or a value that applies to exactly one backend. Invalid values raise ``ValueError`` /
``TypeError`` when the options are built; an option set for a backend it does not apply to
raises ``ValueError`` in :meth:`GDNKernelOptions.check_backend` (called by the dispatch), never
ignored. Results do not depend on the options (only speed and memory do), up to rounding.

Imports nothing of ``overlap_runtime``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: tokens per chunk of the Triton backend: a Triton GDN call (and each CP rank's share of a
#: sequence under the Triton backend) is a whole number of chunks
TRITON_CHUNK = 64

# option name -> the backend it applies to
_APPLIES_TO = {"block_chunks": "eager", "num_segments": "triton", "recompute_w": "triton",
               "fused_forward": "triton"}
# option name -> the type of its values (bool options take exactly True/False)
_BOOL_OPTIONS = frozenset({"recompute_w", "fused_forward"})


@dataclass(frozen=True)
class GDNKernelOptions:
    """Backend tuning knobs (None: the backend's default).

    Attributes:
        block_chunks: eager only. Chunks per recompute block of the memory-lean backward
            (default 4): forward peak memory is one block's intermediates, backward one block's
            graph; a positive int.
        num_segments: triton only. Segments the state scan splits each sequence into (default:
            chosen from the machine, about two programs per SM); a positive int, 1 is the plain
            sequential walk.
        recompute_w: triton only. True: the forward does not save the WY factor w
            (``[B, T, HV, K]`` in the input dtype, 268 MB per layer at T = 32K, HV = 32,
            K = 128, bf16) and the backward forms it again from the saved inverse (one more
            w-only ``wy_fwd`` launch, about 2-3% of forward+backward at 8K; results bit for bit
            the same). Default False: w is saved (docs/gdn.md, "Triton backend"). A bool.
        fused_forward: triton only. True: after two prep kernels that fold the l2 norm in
            (kkt_solve, wy_fwd with the queries' 1/norms; no normalised copy of q, k) the forward
            runs the fused walk (``ops/gdn/triton/fused_fwd.py``: the
            state held on chip across chunks, o written, no per-chunk state or residual in
            memory) instead of the chain's scan and output kernels; it keeps the same saved
            set for the backward, and nothing but o and the final state when no gradient is
            wanted. Default False: faster than the chain in a forward alone, not in
            forward + backward (docs/gdn.md, "Fused forward"). A bool.
    """

    block_chunks: int | None = None
    num_segments: int | None = None
    recompute_w: bool | None = None
    fused_forward: bool | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in _BOOL_OPTIONS:
                if not isinstance(value, bool):
                    raise TypeError(f"GDNKernelOptions.{f.name}={value!r} must be a bool or "
                                    f"None, got {type(value).__name__}")
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"GDNKernelOptions.{f.name}={value!r} must be an int or None, "
                    f"got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"GDNKernelOptions.{f.name}={value} must be >= 1 (or None "
                                 "for the backend's default)")

    def set_options(self) -> dict[str, int | bool]:
        """The options that are set (not None), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def check_backend(self, backend: str) -> None:
        """Raise ``ValueError`` naming every set option that does not apply to ``backend``."""
        wrong = {name: value for name, value in self.set_options().items()
                 if _APPLIES_TO[name] != backend}
        if wrong:
            rules = ", ".join(f"{name}={value} applies to backend={_APPLIES_TO[name]!r} only"
                              for name, value in wrong.items())
            raise ValueError(f"GDNKernelOptions for backend={backend!r}: {rules}; unset it "
                             "(None) or choose that backend")
