"""``check_ranks_agree``: make the ranks of a group compare what they are about to do, first.

A collective whose peers disagree on a size does not fail cleanly: gloo aborts the process
("Received data size doesn't match expected size", SIGABRT), NCCL may hang or read garbage, and a
ring of point-to-point hops with unequal messages does the same. Algorithms that need their
peers to agree on shapes (CP attention: local length, heads, head dim, dtype, batch; a pipeline:
the number of microbatches) call :func:`check_ranks_agree` before their first collective. It
costs one all-gather of ``len(fields)`` int64 per call (no other state: nothing is cached, so a
later call with other shapes is checked too) and, only when the ranks disagree, two bounded
all-gathers of the values' reprs (JSON bytes, nothing unpickled) for the message. Every rank sees
the same gathered codes, so every rank raises the same :class:`ValueError`, naming the first
field that differs and every rank's value::

    ring_attention: ranks disagree on the local sequence length: rank 0 has 64, rank 1 has 32
    (cp group of 2)

Encoding: an ``int`` (``bool`` included) is itself; any other value (a dtype, a string, None, a
shape tuple) is the first 8 bytes of the BLAKE2b digest of its ``repr``, the same on every
rank and process. The number of fields must be the same on every rank (it is, when the fields
are listed by the code, not derived from the data).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .collectives import all_gather
from .handle import CommTimeoutError
from .ranks import group_size


def _code(value: Any) -> int:
    if isinstance(value, int):  # bool too
        return int(value)
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _ranks_text(reprs: list[str]) -> str:
    """``rank 0 has 64, rank 1 has 32`` / ``ranks 0, 1, 3 have 64, rank 2 has 32`` from each
    rank's ``repr`` of its value."""
    groups: dict[str, list[int]] = {}
    for r, text in enumerate(reprs):
        groups.setdefault(text, []).append(r)
    parts = []
    for text, ranks in groups.items():
        if len(ranks) == 1:
            parts.append(f"rank {ranks[0]} has {text}")
        else:
            parts.append(f"ranks {', '.join(map(str, ranks))} have {text}")
    return ", ".join(parts)


def _gather_reprs(reprs: list[str], group: dist.ProcessGroup | None, world: int,
                  device: torch.device | str, timeout_s: float | None) -> list[list[str]]:
    """Every rank's ``reprs`` (JSON bytes in a padded uint8 tensor, two bounded all-gathers)."""
    blob = json.dumps(reprs).encode()
    lengths = all_gather(torch.tensor([len(blob)], dtype=torch.int64).to(device), dim=0,
                         group=group, timeout_s=timeout_s).cpu()
    longest = int(lengths.max())
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    rows = all_gather(buf.to(device), dim=0, group=group, timeout_s=timeout_s)
    rows = rows.view(world, longest).cpu()
    return [json.loads(bytes(rows[r, :int(lengths[r])].tolist()).decode()) for r in range(world)]


def check_ranks_agree(op: str, fields: Sequence[tuple[str, Any]],
                      group: dist.ProcessGroup | None = None, *,
                      device: torch.device | str = "cpu", group_name: str = "cp",
                      timeout_s: float | None = None) -> None:
    """Raise the same ValueError on every rank of ``group`` unless all ranks pass equal values.

    Args:
        op: names the caller in the message (``"ring_attention"``).
        fields: ``(name, value)`` pairs in a fixed order, the same names on every rank;
            ``value`` an int/bool (compared exactly) or anything with a stable ``repr`` (a
            dtype, a string, None, a tuple). The message names the first field that differs.
        device: where the codes travel: a device the group's backend carries (cpu for gloo,
            the ranks' cuda device for nccl; there the check costs one device sync).
        group_name: what the group is, for the message (``"cp"``, ``"pp"``).
        timeout_s: bound of the wait (None: ``comm.DEFAULT_TIMEOUT_S``).

    Raises:
        ValueError: ``"{op}: ranks disagree on {name}: rank 0 has .., rank 1 has .. ({group_name}
            group of P)"`` (plus ``; also on ...`` listing further differing fields), on every rank.
    """
    world = group_size(group)
    if world == 1 or not fields:
        return
    codes = torch.tensor([_code(v) for _, v in fields], dtype=torch.int64)
    what = f"{op}: the ranks' agreement check ({group_name} group of {world})"
    try:
        gathered = all_gather(codes.to(device), dim=0, group=group, timeout_s=timeout_s)
    except CommTimeoutError as exc:
        raise CommTimeoutError(f"{what}: {exc}") from exc
    table = gathered.view(world, len(fields)).cpu()
    differ = [i for i in range(len(fields)) if not bool((table[:, i] == table[0, i]).all())]
    if not differ:
        return
    # Every rank saw the same table, so every rank is here: two more bounded collectives for the
    # message (the values' reprs as JSON bytes: nothing a peer sends is unpickled).
    values = _gather_reprs([repr(v) for _, v in fields], group, world, device, timeout_s)
    first = differ[0]
    per_rank = [values[r][first] for r in range(world)]
    more = "; also on " + ", ".join(fields[i][0] for i in differ[1:]) if differ[1:] else ""
    raise ValueError(f"{op}: ranks disagree on {fields[first][0]}: {_ranks_text(per_rank)} "
                     f"({group_name} group of {world}){more}")

