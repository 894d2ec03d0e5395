"""One task graph per training step: layer programs, the composed step graph, conformance.

``layer_program`` (what one decoder layer issues, op by op, as functions of the microbatch
shape), ``compose`` (``compile_step(config) -> StepGraph``: the pipeline schedule expanded on
every rank of the layout, validated deadlock-free), ``record`` / ``conformance`` (what really
ran, per rank, checked against the graph).
"""

from .layer_program import (Direction, LayerOp, MicrobatchShape, layer_program,
                            microbatch_shape, stage_program)

__all__ = ["Direction", "LayerOp", "MicrobatchShape", "layer_program", "microbatch_shape",
           "stage_program"]
