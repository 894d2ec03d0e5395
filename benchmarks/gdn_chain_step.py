"""The p2p GDN chain as the compiled step of one GDN layer, priced with measured node costs.

Shared by ``benchmarks/gdn_cp_predict.py`` (eager chain, CPU node costs) and
``benchmarks/gdn_cp_nodes.py`` (Triton chain, GPU node costs): :func:`chain_config` is a
training config with one GDN layer (``linear_attention_cp_mode: p2p``) on ``cp`` ranks of
``local_seq`` tokens each; :func:`predict_chain` compiles it (``stepgraph.compile_step``: the
chain the runtime issues, checked by the conformance tests), prices its ops with
``context_parallel.gdn.step_costs.chain_op_seconds`` and simulates it
(``stepgraph.pricing.predict_priced``).
"""

from __future__ import annotations

from typing import Any, Mapping

from overlap_runtime.context_parallel.gdn.step_costs import chain_op_seconds
from overlap_runtime.stepgraph.compose import compile_step
from overlap_runtime.stepgraph.pricing import StepPrediction, predict_priced
from overlap_runtime.trainer import config_from_dict

__all__ = ["chain_config", "predict_chain"]


def chain_config(cp: int, local_seq: int, key_heads: int = 2, value_heads: int = 4,
                 head_dim: int = 64) -> Any:
    """One GDN layer of the given heads on ``cp`` ranks, one sequence of ``cp * local_seq``
    tokens (weak scaling), fp32, pp = 1."""
    return config_from_dict({
        "model": {"hidden_size": value_heads * head_dim, "num_hidden_layers": 1,
                  "layer_types": ["linear_attention"], "intermediate_size": 64,
                  "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
                  "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim},
        "data": {"seq_len": cp * local_seq, "batch_size": 1},
        "train": {"precision": "fp32",
                  "accelerator": {"device": "cpu", "world_size": cp, "cp": cp,
                                  "linear_attention_cp_mode": "p2p"}}})


def predict_chain(costs: Mapping[str, float], message: float, cp: int, local_seq: int,
                  **heads: int) -> StepPrediction:
    """The compiled step of :func:`chain_config` priced with ``costs`` (eager or Triton node
    costs, ``gdn.step_costs``) and one state message costing ``message`` (same unit)."""
    step = compile_step(chain_config(cp, local_seq, **heads))
    return predict_priced(step, chain_op_seconds(costs, cp, message_s=message))
