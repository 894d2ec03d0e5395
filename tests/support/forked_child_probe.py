"""``python -m tests.support.forked_child_probe MODE`` as a forked interpreter child
(``tests/test_forked_child.py``). Prints ``RESULT {json}``: its argv, the environment it runs
under, whether ``tl.sum`` is interpreted, its parent pid and whether torch was imported before
this module ran; then by MODE: ``ok`` exits 0, ``exit3`` exits 3, ``raise`` raises, ``hang``
sleeps (to be killed)."""

from __future__ import annotations

import json
import os
import sys
import time

_TORCH_BEFORE = "torch" in sys.modules

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

mode = sys.argv[1]
print("RESULT " + json.dumps({
    "argv": sys.argv, "name": __name__, "ppid": os.getppid(), "torch_before": _TORCH_BEFORE,
    "interpret": os.environ.get("TRITON_INTERPRET"), "threads": torch.get_num_threads(),
    "tl_sum_interpreted": isinstance(tl.sum, InterpretedFunction)}))
print("to stderr", file=sys.stderr)
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("the probe raised")
if mode == "hang":
    time.sleep(600)
