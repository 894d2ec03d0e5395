"""overlap_runtime: pipeline, expert and context parallelism whose communication hides behind
computation.

Importing the package is cheap: it imports torch and nothing heavy (no Triton, no torch_npu).
Subpackages and modules, lowest first (a lower one never imports a higher one; docs/
architecture.md has the map and tests/test_import_graph.py checks it):

- ``platform``: device kind (cpu | cuda | npu) -> backend (gloo | nccl | hccl), streams, events;
  ``launch``: ``spawn`` for CPU ranks, ``init_from_env`` under torchrun (``rank_start``: how a
  spawned rank starts: the forkserver's import path, the same package as the parent);
  ``testing``: ``run_ranks`` for tests on real gloo ranks
- ``ops``: ``ops.comm`` (bounded collectives, the one point-to-point layer), ``ops.comm_stats``,
  ``ops.gdn`` (Gated DeltaNet math and backends), ``ops.attention`` (local blocks, lse merge)
- ``graph``: the task DAG (validate, simulate, interval arithmetic, traces)
- ``schedules``: pipeline schedules as pure data (IR, spec, kinds, lowering, compile)
- ``config``: the run configuration as pure data (``TrainConfig``, the model's fields, the
  layout's rules, the context-parallel mode registry); no ``torch.distributed``
- ``pipeline``: the torch runtime of schedules (``PipelineStage``, ``PipelineSchedule.step``,
  ``ActionContext``)
- ``coordinator``: the forward/backward comm-token coordinator of ``OVERLAP_B_F`` steps
- ``layers``: plain modules (GatedDeltaNet, attention, norms, RoPE, SwiGLU) with swappable
  strategies for their parallel concerns
- ``moe``: the MoE layer, token dispatcher, expert parallelism and its overlap
- ``context_parallel``: sequence sharding, full-attention CP and (``context_parallel.gdn``) GDN CP
- ``models``: the Qwen3.5-style hybrid decoder and its parallelisation
- ``stepgraph``: one task graph per training step from the configuration, validated before the
  run, checked after it; no ``torch.distributed`` (it plans any scale)
- ``trainer``: ``ParallelDims`` (the meshes) and the training loop
- ``cli``, ``demo``, ``info``: the ``overlap-runtime`` command and its subcommands;
  ``failure``: how the command reports an error (one line, an exit code, a log file)
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
