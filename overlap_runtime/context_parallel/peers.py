"""What the ranks of a CP group must agree on before a CP attention call communicates.

Ring, Ulysses and all_gather_kv exchange messages whose sizes every rank derives from its own
shard: batch, local length, heads, head dim, dtype, and (for the ring's half hops and Ulysses'
reorder) the mask and split rule. A rank that differs would post a message of another size and
gloo would abort the process. :func:`check_attention_call` compares them first with
``comm.check_ranks_agree`` (one all-gather of 10 int64 per call), so every rank raises the same
named ``ValueError`` before any other collective, and the per-rank checks that follow see equal
inputs everywhere (they then raise on every rank alike too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from overlap_runtime.ops import comm


def _dim(x: torch.Tensor, i: int) -> int | None:
    return int(x.shape[i]) if x.dim() > i else None


def check_attention_call(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         group: dist.ProcessGroup | None, causal: Any, load_balance: Any,
                         timeout_s: float | None) -> None:
    """Raise on every rank unless all ranks of ``group`` pass the same call layout.

    Compared, in this order (the message names the first that differs): batch size, local
    sequence length, query heads, key/value heads, head dim, dtype, ``causal``,
    ``load_balance``, then the full shapes and dtypes of q, k, v. Nothing when the group has
    one rank.
    """
    if comm.group_size(group) == 1:
        return
    fields = [
        ("the batch size", _dim(q, 0)),
        ("the local sequence length", _dim(q, 1)),
        ("the query heads", _dim(q, 2)),
        ("the key/value heads", _dim(k, 2)),
        ("the head dim", _dim(q, 3)),
        ("the dtype", q.dtype),
        ("causal", bool(causal)),
        ("load_balance", load_balance),
        ("the shapes of q, k, v", (tuple(q.shape), tuple(k.shape), tuple(v.shape))),
        ("the dtypes of q, k, v", (q.dtype, k.dtype, v.dtype)),
    ]
    comm.check_ranks_agree(op, fields, group, device=q.device, group_name="cp",
                           timeout_s=timeout_s)
