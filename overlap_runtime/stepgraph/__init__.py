"""One task graph per training step: layer programs, the composed step graph, conformance.

``layer_program`` (what one decoder layer issues, op by op, as functions of the microbatch
shape), ``compose`` (``compile_step(config) -> StepGraph``: the pipeline schedule expanded on
every rank of the layout, validated deadlock-free), ``record`` / ``conformance`` (what really
ran, per rank, checked against the graph; the recorder itself is ``ops.step_record``).

May import: ``graph``, ``schedules`` and the configuration floor ``config`` (the run
configuration, the layout, the CP-mode registry), the standard library; never ``trainer`` (the
same layer, which validates and checks through this package) and nothing that imports
torch.distributed: it runs at any scale without ranks.
"""

from .layer_program import (Direction, LayerOp, MicrobatchShape, layer_program,
                            microbatch_shape, stage_program)

__all__ = ["Direction", "LayerOp", "MicrobatchShape", "layer_program", "microbatch_shape",
           "stage_program"]
