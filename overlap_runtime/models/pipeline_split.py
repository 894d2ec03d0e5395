"""Splitting the Qwen3.5-style decoder into pipeline stages.

::

    stage 0        embed_tokens, layers[0 : n0]                       input_ids [mb, S/cp] int64
    stage s        layers[a_s : b_s]                                  hidden [mb, S/cp, hidden]
    stage last     layers[.. : L], norm, lm_head                      -> logits [mb, S/cp, vocab]

The rule (:func:`split_layers`): ``num_stages = pp * virtual_stages`` stages over the
``L = num_hidden_layers`` decoder layers, in order; stage ``s`` gets ``L // num_stages`` layers
plus one more when ``s < L % num_stages``. The extra layers go to the *early* stages because
the last stage already carries the LM head (a ``hidden x vocab`` GEMM and the loss), the
heaviest piece outside the decoder layers, while the first stage's embedding is a gather.
``layers_per_stage`` (``train.pipeline.layers_per_stage`` in YAML) overrides the rule, e.g.
``[3, 5]`` to move work off a slow first stage.

A :class:`Qwen3_5Stage` holds the *same* submodules as the model (no copies): its parameter
names are the model's (``layers.<global index>.…``, ``embed_tokens.weight``, ``lm_head.weight``),
so a checkpoint written by stages loads into the whole model and the other way round. A tied
embedding cannot be split across stages (the trainer refuses ``tie_word_embeddings`` with
``pp > 1``).

Position ids are not passed between stages: every stage derives the positions of its
contiguous CP shard from the model's ``cp_rank`` (set by ``parallelize_qwen3_5_cp``) and the
local length, exactly as the unsplit model does when the caller passes none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from overlap_runtime.config.layout import split_layers
from overlap_runtime.models.qwen3_5 import Qwen3_5ForCausalLM


class Qwen3_5Stage(nn.Module):
    """Stage ``stage_index`` of ``num_stages``: a contiguous run of the model's layers.

    Args:
        model: the whole model (already context parallel, not yet FSDP-sharded).
        stage_index, num_stages: this stage and the stage count.
        layer_range: the decoder layers it runs (global indices).

    ``forward``: first stage ``input_ids [mb, S_local] int64``, other stages
    ``hidden [mb, S_local, hidden]`` in the parameters' dtype; the last stage returns logits
    ``[mb, S_local, vocab]``, the others ``hidden``.
    """

    def __init__(self, model: Qwen3_5ForCausalLM, stage_index: int, num_stages: int,
                 layer_range: range) -> None:
        super().__init__()
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index} outside [0, {num_stages})")
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.cp_rank = model.cp_rank
        self.embed_tokens = model.embed_tokens if self.is_first else None
        # Keys are the global layer indices, so parameter names equal the model's.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_range})
        if model.config.mlp == "moe" and model.config.moe_aux_loss_pooling == "model":
            raise ValueError("model.moe_aux_loss_pooling='model' pools over every MoE layer of "
                             "one forward: a pipeline stage holds only some of them (use "
                             "'per_layer' with pp > 1)")
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            if x.dtype != torch.int64:
                raise TypeError(f"stage {self.stage_index} (first) takes input_ids int64, got "
                                f"{x.dtype}")
            h = self.embed_tokens(x)
        else:
            h = x
        local_len = h.shape[1]
        start = self.cp_rank * local_len
        position_ids = torch.arange(start, start + local_len, device=h.device)
        for layer in self.layers.values():
            h = layer(h, position_ids)
        if self.lm_head is not None:
            assert self.norm is not None
            return self.lm_head(self.norm(h))
        return h


def split_qwen3_5(model: Qwen3_5ForCausalLM, num_stages: int, stage_indices: Sequence[int],
                  layers_per_stage: Sequence[int] | None = None) -> dict[int, Qwen3_5Stage]:
    """The stages ``stage_indices`` (this rank's) of ``model`` split into ``num_stages``.

    Returns ``{stage index: Qwen3_5Stage}``; the model's other layers are simply not referenced
    by any returned stage (drop the model to free them).
    """
    ranges = split_layers(len(model.layers), num_stages, layers_per_stage)
    return {s: Qwen3_5Stage(model, s, num_stages, ranges[s]) for s in stage_indices}
