"""The tiny fp32 trainer layouts shared by the layout tests, the step-graph tests and
benchmarks/trainer_layouts.py: each a config dict for ``config_from_dict``, hidden 32, 4 layers,
4 sequences of 64 tokens per dp rank, checked against one device by tests/trainer/test_trainer_4d.py
(TWO_RANKS, FOUR_RANKS; EIGHT_RANKS only by the step-graph tests: its trained check is
examples/train_4d.py's, which tests/test_examples.py runs)."""

from __future__ import annotations

from typing import Any

STEPS = 5

MOE = {"mlp": "moe", "num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 32}
CP_MODES = {"linear_attention_cp_mode": "p2p", "full_attention_cp_mode": "ring"}


def layout(world: int, model: dict[str, Any] | None = None,
           pipeline: dict[str, Any] | None = None, steps: int = STEPS, **acc: Any
           ) -> dict[str, Any]:
    """A tiny fp32 configuration: hidden 32, 4 layers, 4 sequences of 64 tokens per dp rank."""
    accelerator = {"device": "cpu", "cp": 1, "world_size": world, "comm_timeout_s": 60.0, **acc}
    return {
        "model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
                  **(model or {})},
        "data": {"seq_len": 64, "batch_size": 4},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "train": {"steps": steps, "seed": 0, "precision": "fp32", "accelerator": accelerator,
                  "pipeline": pipeline or {}, "check_conformance": True},
    }


def pp2(schedule: str, **pipeline: Any) -> dict[str, Any]:
    return {"schedule": schedule, "microbatches": 4, **pipeline}


TWO_RANKS = {
    "pp2_gpipe": layout(2, pp=2, pipeline=pp2("gpipe")),
    "pp2_1f1b": layout(2, pp=2, pipeline=pp2("1f1b")),
    "pp2_interleaved_1f1b": layout(2, pp=2, pipeline=pp2("interleaved_1f1b", virtual_stages=2)),
    "pp2_zero_bubble": layout(2, pp=2, pipeline=pp2("zero_bubble")),
    "pp2_dualpipev": layout(2, pp=2, pipeline=pp2("dualpipev", virtual_stages=2)),
    "ep2_cp2": layout(2, model=MOE, ep=2, cp=2, **CP_MODES),
}
FOUR_RANKS = {
    "pp2_ep2_overlap_b_f": layout(4, model=MOE, pp=2, ep=2,
                                  pipeline=pp2("interleaved_1f1b", virtual_stages=2,
                                               overlap_b_f=True)),
    # expert W tasks deferred to the rank's queue and run in the EP all-to-all windows (dp_shard
    # 2: the tasks accumulate into FSDP's gathered parameters before the reduce-scatter); where
    # they ran: tests/moe/test_moe_deferred_w.py::test_trainer_flushes_expert_w_in_the_windows
    "pp2_ep2_zero_bubble_defer_w": layout(4, model=MOE, pp=2, ep=2,
                                          pipeline=pp2("zero_bubble", defer_expert_w=True)),
    "pp2_ep2_dualpipev_defer_w": layout(4, model=MOE, pp=2, ep=2,
                                        pipeline=pp2("dualpipev", virtual_stages=2,
                                                     defer_expert_w=True)),
    "pp2_cp2": layout(4, pp=2, cp=2, **CP_MODES, pipeline=pp2("1f1b", microbatches=2)),
    "dp2_pp2": layout(4, pp=2, dp_shard=2, pipeline=pp2("1f1b", microbatches=2)),
    # hierarchical attention CP (a2a 2 inside x ring 2 across): its messages on the cp_a2a and
    # cp_ring groups checked against the step graph
    "cp4_hierarchical": layout(4, cp=4, steps=2, linear_attention_cp_mode="p2p",
                               full_attention_cp_mode="hierarchical",
                               hierarchical_cp={"a2a": 2, "ring": 2}),
    "pp2_ep2_top2_overlap_b_f": layout(4, model={**MOE, "num_experts_per_tok": 2}, pp=2, ep=2,
                                       steps=1,
                                       pipeline=pp2("interleaved_1f1b", virtual_stages=2,
                                                    overlap_b_f=True)),
}
EIGHT_RANKS = {
    "pp2_ep2_cp2": layout(8, model=MOE, pp=2, ep=2, cp=2, **CP_MODES,
                          pipeline=pp2("interleaved_1f1b", virtual_stages=2)),
}
