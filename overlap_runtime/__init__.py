"""overlap_runtime: pipeline, expert and context parallelism whose communication hides behind
computation.

Importing the package is cheap: it imports torch and nothing heavy (no Triton, no torch_npu).
Subpackages: ``platform``, ``launch``, ``testing``, ``ops`` (collectives, GDN, attention),
``graph`` (task DAG), ``schedules`` (pipeline IR and runtime), ``coordinator``, ``moe``,
``context_parallel``, ``models``, ``trainer``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
