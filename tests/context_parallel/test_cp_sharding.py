"""Sequence sharding: which tokens each rank holds, round trips, batches, and the errors."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.context_parallel import (
    shard_batch,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from overlap_runtime.context_parallel.sharding import (
    check_sequence_length,
    reorder_to_sequence,
    reorder_to_shards,
    sequence_permutation,
)


def test_zigzag_positions_are_chunks_r_and_mirror() -> None:
    # S = 16, P = 4: chunks of 2; rank r holds chunks r and 7 - r.
    expected = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}
    for r, pos in expected.items():
        assert shard_positions(16, 4, r, "zigzag").tolist() == pos
    assert shard_positions(16, 4, 1, None).tolist() == [4, 5, 6, 7]
    assert sequence_permutation(8, 2, "zigzag").tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_zigzag_balances_causal_work() -> None:
    """Every rank gets the same number of (query, key) pairs under a causal mask."""
    for p in (2, 4, 8):
        work = [int((shard_positions(64, p, r, "zigzag") + 1).sum()) for r in range(p)]
        assert len(set(work)) == 1, work
        contiguous = [int((shard_positions(64, p, r, None) + 1).sum()) for r in range(p)]
        assert contiguous[-1] > contiguous[0]


@pytest.mark.parametrize("load_balance", ["zigzag", None])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_round_trip_tokens_labels_positions_masks(load_balance, p: int) -> None:
    s = 32
    g = torch.Generator().manual_seed(p)
    batch = {
        "tokens": torch.randint(0, 1000, (2, s), generator=g),
        "labels": torch.randint(0, 1000, (2, s), generator=g),
        "loss_mask": torch.rand(2, s, generator=g) > 0.3,
        "position_ids": torch.arange(s).expand(2, s),
        "attention_mask": torch.rand(2, 1, s, s, generator=g) > 0.5,
        "hidden": torch.randn(2, s, 3, generator=g),
        "cu_seqlens": None,
        "max_seqlen": s,
    }
    shards = [shard_batch(batch, p, r, load_balance) for r in range(p)]
    for r, sh in enumerate(shards):
        pos = shard_positions(s, p, r, load_balance)
        # position ids follow their tokens (RoPE sees the true positions)
        assert torch.equal(sh["position_ids"][0], pos)
        assert torch.equal(sh["tokens"], batch["tokens"][:, pos])
        assert torch.equal(sh["attention_mask"], batch["attention_mask"][:, :, pos])
        assert sh["attention_mask"].shape == (2, 1, s // p, s)
        assert sh["cu_seqlens"] is None and sh["max_seqlen"] == s
    for key in ("tokens", "labels", "loss_mask", "position_ids", "hidden"):
        assert torch.equal(unshard_sequence([sh[key] for sh in shards], 1, load_balance), batch[key])
    assert torch.equal(unshard_sequence([sh["attention_mask"] for sh in shards], 2, load_balance),
                       batch["attention_mask"])


def test_reorder_round_trip_and_shard_is_differentiable() -> None:
    x = torch.randn(1, 24, 2, requires_grad=True)
    assert torch.equal(reorder_to_sequence(reorder_to_shards(x, 3), 3), x)
    shard = shard_sequence(x, 3, 1, 1, "zigzag")
    shard.sum().backward()
    expected = torch.zeros(24)
    expected[shard_positions(24, 3, 1)] = 1
    assert torch.equal(x.grad[0, :, 0], expected)


def test_sequence_length_errors_name_values() -> None:
    with pytest.raises(ValueError, match=r"sequence length 30 is not a multiple of 2 \* cp_size"
                                         r".* = 8 \(cp_size=4, load_balance='zigzag'\)"):
        check_sequence_length(30, 4, "zigzag")
    with pytest.raises(ValueError, match=r"sequence length 30 is not a multiple of cp_size "
                                         r"\(contiguous split\) = 4"):
        shard_positions(30, 4, 0, None)
    assert check_sequence_length(28, 4, None) == 4        # contiguous needs only S % P
    with pytest.raises(ValueError, match=r"sequence length 28 .* = 8"):
        shard_sequence(torch.zeros(1, 28), 4, 0, 1, "zigzag")
    with pytest.raises(ValueError, match="cp_rank 4 out of range for cp_size 4"):
        shard_positions(32, 4, 4)
    with pytest.raises(ValueError, match="load_balance must be 'zigzag' or None"):
        shard_positions(32, 4, 0, "stripe")
    with pytest.raises(ValueError, match="'labels' has sequence length 15 along dim 1 but "
                                         "'tokens' has 16"):
        shard_batch({"tokens": torch.zeros(1, 16), "labels": torch.zeros(1, 15)}, 2, 0)


@pytest.mark.parametrize("load_balance", ["zigzag", None])
def test_out_of_range_seq_dim_raises_index_error(load_balance) -> None:
    """An out-of-range ``seq_dim`` raises IndexError naming it and the tensor's ndim, as torch
    does, instead of wrapping around (``seq_dim % ndim``) to another dim; negative dims within
    range keep working."""
    from overlap_runtime.context_parallel.sharding import gather_sequence

    x = torch.arange(2 * 8 * 4).reshape(2, 8, 4)
    msg = r"seq_dim=(3|-4|5) .*ndim 3"
    for bad in (3, -4, 5):  # wrapped before: 3 -> 0, -4 -> 2, 5 -> 2
        with pytest.raises(IndexError, match=msg):
            shard_sequence(x, 2, 0, bad, load_balance)
        with pytest.raises(IndexError, match=msg):
            reorder_to_sequence(x, 2, bad, load_balance)
        with pytest.raises(IndexError, match=msg):
            reorder_to_shards(x, 2, bad, load_balance)
        with pytest.raises(IndexError, match=msg):
            unshard_sequence([x, x], bad, load_balance)
        with pytest.raises(IndexError, match=msg):  # raised before any collective
            gather_sequence(x, None, bad, load_balance)
    # negative dims in range are the same dims as their positive forms
    for r in range(2):
        assert torch.equal(shard_sequence(x, 2, r, -2, load_balance),
                           shard_sequence(x, 2, r, 1, load_balance))
    assert torch.equal(reorder_to_shards(x, 2, -2, load_balance), reorder_to_shards(x, 2, 1, load_balance))
    assert torch.equal(reorder_to_sequence(x, 2, -2, load_balance),
                       reorder_to_sequence(x, 2, 1, load_balance))
    assert torch.equal(unshard_sequence([shard_sequence(x, 2, r, -2, load_balance) for r in range(2)],
                                        -2, load_balance), x)
