"""Splitting a sequence across context-parallel ranks, and putting it back together.

Two rules, named by ``load_balance``:

* ``None`` (contiguous): rank ``r`` of ``P`` holds tokens ``[r*S/P, (r+1)*S/P)``;
  ``S % P == 0``.
* ``"zigzag"``: the sequence is cut into ``2P`` equal chunks and rank ``r`` holds chunks ``r``
  and ``2P-1-r``, in that order; ``S % (2P) == 0``.

Tokens, labels, loss masks and **position ids** are split by the same rule, so a token's
position id travels with it and RoPE (a function of the absolute position) stays right. An
``[B, 1, S, S]`` attention mask is split along its query rows (dim 2), as Megatron does.

Note [zigzag layout]
--------------------
Under a causal mask, query ``i`` does ``i + 1`` units of work, so a contiguous split gives the
last rank ``2P - 1`` times the work of the first. Zigzag pairs a light chunk with a heavy one.
``P = 2``, ``S = 8``, chunks of 2 tokens::

    chunk        c0    c1    c2    c3
    tokens      0 1   2 3   4 5   6 7
    rank         0     1     1     0          rank 0 holds [c0, c3] = tokens 0 1 6 7
                                              rank 1 holds [c1, c2] = tokens 2 3 4 5

    causal mask (row = query, col = key; x = attended), by owner of the query row:

              key: 0 1 2 3 4 5 6 7
    q0  r0         x . . . . . . .
    q1  r0         x x . . . . . .       rank 0 rows: 1 + 2 + 7 + 8 = 18 units
    q2  r1         x x x . . . . .
    q3  r1         x x x x . . . .       rank 1 rows: 3 + 4 + 5 + 6 = 18 units
    q4  r1         x x x x x . . .
    q5  r1         x x x x x x . .       (contiguous: rank 0 gets 1+2+3+4 = 10,
    q6  r0         x x x x x x x .                    rank 1 gets 5+6+7+8 = 26)
    q7  r0         x x x x x x x x

A rank's local tokens are increasing in position (``c_r`` before ``c_{2P-1-r}``), so a causal
mask over the *local* indices of one rank's own tokens is the true causal mask: the ring's
diagonal step is an ordinary causal block. ``ring.py`` derives the off-diagonal cases from this
layout.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from overlap_runtime.ops import comm

LoadBalance = Optional[Literal["zigzag"]]

#: Sequence dimension per batch key; keys not listed use dim 1.
DEFAULT_SEQ_DIMS: dict[str, int] = {"attention_mask": 2}


def check_load_balance(load_balance: Any) -> LoadBalance:
    """Return ``load_balance`` if it is ``"zigzag"`` or None; raise otherwise."""
    if load_balance not in ("zigzag", None):
        raise ValueError(f"load_balance must be 'zigzag' or None (contiguous), got {load_balance!r}")
    return load_balance


def check_sequence_length(seq_len: int, cp_size: int, load_balance: LoadBalance) -> int:
    """Raise unless ``seq_len`` splits under the rule; return the number of chunks (P or 2P)."""
    check_load_balance(load_balance)
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    chunks = 2 * cp_size if load_balance == "zigzag" else cp_size
    if seq_len % chunks:
        rule = ("2 * cp_size (zigzag: rank r holds chunks r and 2P-1-r)"
                if load_balance == "zigzag" else "cp_size (contiguous split)")
        raise ValueError(f"sequence length {seq_len} is not a multiple of {rule} = {chunks} "
                         f"(cp_size={cp_size}, load_balance={load_balance!r})")
    return chunks


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")


def _seq_dim(x: torch.Tensor, seq_dim: int, fn: str) -> int:
    """``seq_dim`` as a non-negative dim of ``x``; out of range raises IndexError as torch does.

    (A bare ``seq_dim % x.dim()`` would wrap an out-of-range dim onto another dim and return
    the wrong slice, or a misleading length error.) Negative dims in ``[-ndim, -1]`` count from
    the end.
    """
    ndim = x.dim()
    if not -ndim <= seq_dim < ndim:
        raise IndexError(
            f"{fn}: seq_dim={seq_dim} is out of range for a tensor of ndim {ndim} "
            f"(shape {tuple(x.shape)}); expected a dim in [{-ndim}, {ndim - 1}]"
        )
    return seq_dim % ndim


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, load_balance: LoadBalance = "zigzag",
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (position ids) of the tokens rank ``cp_rank`` holds, in local order.

    Returns an int64 tensor ``[seq_len // cp_size]``; under zigzag it is increasing but not
    contiguous (``[r*c .. (r+1)*c) ++ [(2P-1-r)*c .. (2P-r)*c)``, ``c = seq_len / 2P``).
    """
    chunks = check_sequence_length(seq_len, cp_size, load_balance)
    _check_rank(cp_size, cp_rank)
    c = seq_len // chunks
    if load_balance == "zigzag":
        ids = [cp_rank, 2 * cp_size - 1 - cp_rank]
    else:
        ids = [cp_rank]
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def sequence_permutation(seq_len: int, cp_size: int, load_balance: LoadBalance = "zigzag",
                         device: torch.device | str | None = None) -> torch.Tensor:
    """Positions of the rank-ordered concatenation of all shards: ``cat_r shard_positions(r)``.

    ``shards_concat = full.index_select(dim, perm)`` and ``full = shards_concat.index_select(dim,
    argsort(perm))``. The identity for the contiguous rule.
    """
    return torch.cat([shard_positions(seq_len, cp_size, r, load_balance, device)
                      for r in range(cp_size)])


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1,
                   load_balance: LoadBalance = "zigzag") -> torch.Tensor:
    """The part of ``x`` (full sequence along ``seq_dim``) that rank ``cp_rank`` holds.

    Works for any tensor (tokens ``[B, S]``, hidden ``[B, S, C]``, q ``[B, S, H, D]``, an
    ``[B, 1, S, S]`` mask with ``seq_dim=2``) and any dtype; differentiable (index_select).
    A ``seq_dim`` outside ``[-x.dim(), x.dim() - 1]`` raises IndexError (no wrap-around).
    """
    dim = _seq_dim(x, seq_dim, "shard_sequence")
    pos = shard_positions(x.shape[dim], cp_size, cp_rank, load_balance, x.device)
    if load_balance is None:  # a view, no copy
        return x.narrow(dim, int(pos[0]), pos.numel())
    return x.index_select(dim, pos)


def reorder_to_sequence(x: torch.Tensor, cp_size: int, seq_dim: int = 1,
                        load_balance: LoadBalance = "zigzag") -> torch.Tensor:
    """Rank-ordered concatenation of shards (what a gather returns) -> true sequence order."""
    dim = _seq_dim(x, seq_dim, "reorder_to_sequence")
    if load_balance is None:
        return x
    perm = sequence_permutation(x.shape[dim], cp_size, load_balance, x.device)
    return x.index_select(dim, torch.argsort(perm))


def reorder_to_shards(x: torch.Tensor, cp_size: int, seq_dim: int = 1,
                      load_balance: LoadBalance = "zigzag") -> torch.Tensor:
    """True sequence order -> rank-ordered concatenation of shards (inverse of the above)."""
    dim = _seq_dim(x, seq_dim, "reorder_to_shards")
    if load_balance is None:
        return x
    return x.index_select(dim, sequence_permutation(x.shape[dim], cp_size, load_balance, x.device))


def unshard_sequence(shards: Sequence[torch.Tensor], seq_dim: int = 1,
                     load_balance: LoadBalance = "zigzag") -> torch.Tensor:
    """Rebuild the full sequence from every rank's shard (``shards[r]`` from rank ``r``)."""
    if not shards:
        raise ValueError("unshard_sequence: no shards given")
    dim = _seq_dim(shards[0], seq_dim, "unshard_sequence")
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1:
        raise ValueError(f"unshard_sequence: shards differ in length along dim {dim}: "
                         f"{[s.shape[dim] for s in shards]}")
    return reorder_to_sequence(torch.cat(list(shards), dim), len(shards), dim, load_balance)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, seq_dim: int = 1,
                    load_balance: LoadBalance = "zigzag",
                    timeout_s: float | None = None) -> torch.Tensor:
    """All-gather every rank's shard and return the full sequence in true order.

    Differentiable (``comm.all_gather``; backward hands each rank its slice's gradient summed
    over ranks). One all-gather collective.
    """
    dim = _seq_dim(x, seq_dim, "gather_sequence")  # before the collective, on every rank
    full = comm.all_gather(x, dim, group, timeout_s)
    return reorder_to_sequence(full, comm.group_size(group), dim, load_balance)


def shard_batch(batch: Mapping[str, Any], cp_size: int, cp_rank: int,
                load_balance: LoadBalance = "zigzag",
                seq_dims: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Split every sequence tensor of a batch by one rule; leave everything else as is.

    Tensors are split along ``seq_dims.get(key, DEFAULT_SEQ_DIMS.get(key, 1))`` (``tokens``,
    ``labels``, ``loss_mask``, ``position_ids`` along dim 1, ``attention_mask`` along dim 2).
    ``None`` values (e.g. tokens on a middle pipeline stage) and non-tensors (metadata) pass
    through. Every split tensor must have the same length along its sequence dim; a mismatch
    raises naming the key.
    """
    dims = dict(DEFAULT_SEQ_DIMS)
    dims.update(seq_dims or {})
    out: dict[str, Any] = {}
    seq_len: int | None = None
    first_key = ""
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor):
            out[key] = val
            continue
        dim = dims.get(key, 1)
        if not -val.dim() <= dim < val.dim():
            raise ValueError(f"shard_batch: {key!r} has shape {tuple(val.shape)}, no sequence "
                             f"dim {dim}")
        n = val.shape[dim]
        if seq_len is None:
            seq_len, first_key = n, key
        elif n != seq_len:
            raise ValueError(f"shard_batch: {key!r} has sequence length {n} along dim {dim} but "
                             f"{first_key!r} has {seq_len}")
        out[key] = shard_sequence(val, cp_size, cp_rank, dim, load_balance)
    return out
