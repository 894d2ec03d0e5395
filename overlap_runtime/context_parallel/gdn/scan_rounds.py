"""Exclusive prefix of affine maps over the CP ranks in ``ceil(log2 P)`` point-to-point rounds.

Each CP position ``p`` holds one affine map ``c_p = (M_p, S_p)`` (``h -> M_p h + S_p``, M
``[B, HV, K, K]``, S ``[B, HV, K, N]``); position ``p`` wants the state that enters it from a
zero start, ``H_p = S of (c_(p-1) o ... o c_0)`` (``compose`` of ``ops.gdn``: associative, not
commutative). The forward of ``mode="prefix_scan"`` runs it in rank order with the ranks'
summaries; the backward runs it in reverse rank order with the transposed summaries and the
local state gradients, ``(M_r^T, dH_in_local_r)``, which gives every rank its ``dH_out``.

Algorithm: Hillis-Steele, exclusive form. Round ``d = 0 .. ceil(log2 P) - 1``: position ``p``
sends ``acc = c_p o excl`` to ``p + 2^d`` and receives from ``p - 2^d``, whose ``acc`` covers
positions ``[p - 2^(d+1) + 1, p - 2^d]``; ``excl <- excl o received``. At round ``d``'s start
``excl`` covers ``[p - 2^d + 1, p - 1]``, so after the last round it covers ``[0, p - 1]``::

    P = 6       round 0 (+1)        round 1 (+2)          round 2 (+4)
    p=0   c0    -> 1                -> 2                  -> 4            (a state: S0 only)
    p=1   c1    -> 2    <- 0        -> 3                  -> 5
    p=2   c2    -> 3    <- 1 (pair) -> 4     <- 0 (state)
    p=3   c3    -> 4    <- 2 (pair) -> 5     <- 1 (state)
    p=4   c4    -> 5    <- 3 (pair)          <- 2 (pair)          <- 0 (state)
    p=5   c5            <- 4 (pair)          <- 3 (pair)          <- 1 (state)

Why Hillis-Steele and not Blelloch: Blelloch's up-sweep + down-sweep sends ``2 (P - 1)``
messages in all but needs ``2 ceil(log2 P)`` rounds; Hillis-Steele needs ``ceil(log2 P)``
rounds at ``P ceil(log2 P) - 2^ceil(log2 P) + 1`` messages. A round's cost is one message
latency plus one compose (a ``K x K x (K + N)`` product): at CP 16-64 the state messages are
small (1-4 MiB) and latency-bound, the ranks have idle links (each sends at most one message per
round), so halving the rounds is what shortens the critical path; the extra messages cost link
bytes that are otherwise unused.

Message sizes follow from ``(p, d)`` alone, so every rank sizes its receive buffers without
asking: a sender whose ``acc`` window reaches position 0 (``p < 2^d``) sends the state only
(``[B, HV, K, N]``: an ``M`` applied to the zero start is irrelevant); otherwise it sends the pair
packed ``[B, HV, K, K + N]``. Position 0 never needs ``M_0``; the last position never sends and
needs no map at all; the maps are needed only where ``0 < p < P - 1``.

Ordering: every pair of ranks exchanges at most one message of the scan per direction (the
peers ``p +- 2^d`` differ per round); between ``r`` and ``r + 1`` the conv halo goes first in
both ranks' program order, so untagged matching pairs them. Every receive is posted when
:class:`AffinePrefixRounds` is built (before the local work), every wait is bounded
(``ops.comm``), the sends are waited last (:meth:`AffinePrefixRounds.finish`).
"""

from __future__ import annotations

import math

import torch

from overlap_runtime.ops import comm
from overlap_runtime.ops.gdn import compose

from .common import GDNCPPlan, post_recv, post_send


def scan_rounds(cp_size: int) -> int:
    """``ceil(log2 P)``: the rounds of the scan over ``P`` positions (0 for one position)."""
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1")
    return math.ceil(math.log2(cp_size)) if cp_size > 1 else 0


def scan_messages(cp_size: int, position: int) -> list[tuple[int, str, int, bool]]:
    """The messages of one position in issue order: ``(round, "recv" | "send", peer position,
    full)``, ``full`` True for an ``(M, S)`` pair and False for a state. Receives of every round
    come first (posted up front), then the sends round by round (a send of round ``d`` leaves
    after the receives of rounds ``< d`` were composed)."""
    if not 0 <= position < cp_size:
        raise ValueError(f"position {position} is not in a scan over {cp_size} positions")
    out: list[tuple[int, str, int, bool]] = []
    rounds = scan_rounds(cp_size)
    for d in range(rounds):
        src = position - (1 << d)
        if src >= 0:
            out.append((d, "recv", src, src >= (1 << d)))
    for d in range(rounds):
        dst = position + (1 << d)
        if dst < cp_size:
            out.append((d, "send", dst, position >= (1 << d)))
    return out


class AffinePrefixRounds:
    """One exclusive scan (module docstring) on one rank: receives posted at construction.

    Args:
        plan: the CP plan (group, rank, bound of every wait).
        reverse: False: position = CP rank (forward, states); True: position = ``P - 1 - rank``
            (backward, state gradients through the transposed maps).
        state_shape: ``(B, HV, K, N)`` of the states; the maps are ``[B, HV, K, K]``.
        dtype, device: of every message (fp32, or float64 for float64 inputs).
        what: names the messages in errors (``"{what} round {d}"``).
    """

    def __init__(self, plan: GDNCPPlan, reverse: bool, state_shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device, what: str) -> None:
        self.plan, self.reverse, self.what, self.dtype = plan, reverse, what, dtype
        world = plan.cp_size
        rank = plan.rank
        self.position = world - 1 - rank if reverse else rank
        self.state_shape = tuple(state_shape)
        batch, heads, key_dim, cols = self.state_shape
        self._sends: list[comm.AsyncHandle] = []
        self._recvs: dict[int, tuple[torch.Tensor, comm.AsyncHandle, bool]] = {}
        self._messages = scan_messages(world, self.position)
        for d, kind, peer, full in self._messages:
            if kind != "recv":
                continue
            width = key_dim + cols if full else cols
            buf = torch.empty(batch, heads, key_dim, width, dtype=dtype, device=device)
            self._recvs[d] = (buf, post_recv(buf, self._rank_of(peer), plan,
                                             f"{what} round {d}"), full)

    def _rank_of(self, position: int) -> int:
        return self.plan.cp_size - 1 - position if self.reverse else position

    def run(self, m: torch.Tensor | None, s: torch.Tensor | None) -> torch.Tensor | None:
        """Run the rounds with this position's map; returns the exclusive prefix's state.

        Args:
            m: ``[B, HV, K, K]`` this position's map (needed where ``0 < p < P - 1``, else
                ignored, may be None).
            s: ``[B, HV, K, N]`` this position's offset (needed where ``p < P - 1``).

        Returns:
            ``[B, HV, K, N]`` in the messages' dtype: the state entering this position from a
            zero start, or None at position 0 (nothing before it: zeros).
        """
        world, p = self.plan.cp_size, self.position
        if p < world - 1 and s is None:
            raise ValueError(f"{self.what}: position {p} of {world} sends, it needs its offset S")
        if 0 < p < world - 1 and m is None:
            raise ValueError(f"{self.what}: position {p} of {world} sends pairs, it needs M")
        ex_m: torch.Tensor | None = None  # excl = (ex_m, ex_s); None, None = the identity
        ex_s: torch.Tensor | None = None
        for d in range(scan_rounds(world)):
            dst = p + (1 << d)
            if dst < world:
                self._send(d, dst, m, s, ex_m, ex_s)
            if d in self._recvs:
                buf, handle, full = self._recvs.pop(d)
                handle.wait()
                key_dim = buf.shape[-2]
                r_m = buf[..., :key_dim] if full else None
                r_s = buf[..., key_dim:] if full else buf
                ex_m, ex_s = _compose_onto(ex_m, ex_s, r_m, r_s)
        return None if ex_s is None else ex_s.contiguous()

    def _send(self, d: int, dst: int, m: torch.Tensor | None, s: torch.Tensor | None,
              ex_m: torch.Tensor | None, ex_s: torch.Tensor | None) -> None:
        """Send ``acc = c_p o excl``: the pair while the window misses position 0, else the
        state (``S`` of the composition)."""
        assert s is not None
        dtype = self.dtype
        full = self.position >= (1 << d)
        s = s.to(dtype)
        if ex_s is None:  # excl is the identity: acc = c_p
            acc_m, acc_s = (m.to(dtype) if full and m is not None else None), s
        elif full:
            assert m is not None and ex_m is not None
            acc_m, acc_s = compose((m.to(dtype), s), (ex_m, ex_s))
        else:
            assert m is not None
            acc_m, acc_s = None, m.to(dtype) @ ex_s + s
        payload = torch.cat([acc_m, acc_s], dim=-1) if full else acc_s.contiguous()
        self._sends.append(post_send(payload, self._rank_of(dst), self.plan,
                                     f"{self.what} round {d}"))

    def finish(self) -> None:
        """Wait every send (late: after the local work that followed the scan)."""
        if self._recvs:
            raise RuntimeError(f"{self.what}: finish() before run() consumed the receives of "
                               f"rounds {sorted(self._recvs)} (rank {self.plan.rank})")
        for h in self._sends:
            h.wait()
        self._sends.clear()


def _compose_onto(ex_m: torch.Tensor | None, ex_s: torch.Tensor | None, r_m: torch.Tensor | None,
                  r_s: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``excl o received`` (received ran first). ``r_m`` None: the received map starts at
    position 0, so it is a state and so is the result (its ``M`` would multiply zeros)."""
    if ex_s is None:
        return r_m, r_s
    assert ex_m is not None
    if r_m is None:
        return None, ex_m @ r_s + ex_s
    return compose((ex_m, ex_s), (r_m, r_s))
