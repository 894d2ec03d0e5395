"""Benchmarks: each module runs as ``python -m benchmarks.<name>`` from the repository root
(``torchrun ... -m benchmarks.<name>`` for the multi-rank ones); ``benchmarks._timing`` holds
the timing helpers they share."""
