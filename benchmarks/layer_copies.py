"""What one GDN (and one attention) layer pays outside its kernels: every op that materialises
memory without arithmetic, with its bytes and the line of ``overlap_runtime`` that caused it
(issue #29).

One layer runs forward + backward under :class:`CopyCounter`, a ``TorchDispatchMode`` that
records each copy-kind aten op (``COPY_OPS``: ``copy_``, ``clone`` - what ``.contiguous()`` of a
strided view becomes -, ``_to_copy`` - dtype casts -, ``cat``, ``constant_pad_nd``, the index and
scatter copies, ``slice_backward`` ...) with the bytes of its output (numel x element size, the
bytes it writes; it reads about as many) and where it came from: the innermost frame of the
Python stack inside ``overlap_runtime`` (plus the innermost ``layers/`` frame when that differs).
In backward, an op of a built-in autograd formula (the ``cat`` of ``split``'s backward, the
scatter of a slice's) has no package frame on the live stack; it is attributed to the forward
line that created its autograd node (anomaly mode keeps that stack), marked ``bwd of``.

Not counted: copies inside one kernel (cuDNN's or MKL's internal reorders, Triton), and ops that
Triton's CPU interpreter (``TRITON_INTERPRET=1``) issues to move a launch's arguments (any op
with a ``triton`` package frame on its stack): they are no copies of the program. With
``--compile on`` (``layers.compile.compile_elementwise``, what ``train.compile`` applies) the
counter is paused while the compiler traces and on again while the compiled code runs
(``ignore_compile_internals``), so what it lists are the copies that survive compilation:
those outside the compiled regions and the compiled graphs' own aten calls.

Bytes are shape arithmetic, so ``--scale-to T`` runs the layer at ``--tokens`` t and 2t and
extrapolates every row as ``a + b * T`` (exact for rows that are affine in T: per-token tensors
plus parameter-sized ones).

    python -m benchmarks.layer_copies                                  # CPU fp32, small layer
    python -m benchmarks.layer_copies --hidden 2048 --tokens 128 --scale-to 32768 --dtype bf16
    python -m benchmarks.layer_copies --device cuda --dtype bf16 --tokens 32768 \\
        --gdn-backend triton --compile on                              # the lead, on the GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


import overlap_runtime  # noqa: E402

__all__ = ["COPY_OPS", "CopyCounter", "CopyRecord", "layer_copies", "main", "summarize",
           "totals"]

_aten = torch.ops.aten
#: op packet -> the kind printed in the table. Copies without arithmetic: data movement,
#: dtype casts, padding, concatenation, gathers and scatters; ``zero_`` / ``fill_`` are the
#: memsets of zero-filled gradient buffers.
COPY_OPS: dict[Any, str] = {
    _aten.copy_: "copy_", _aten.clone: "clone", _aten._to_copy: "_to_copy (cast)",
    _aten.cat: "cat", _aten.stack: "stack", _aten.constant_pad_nd: "constant_pad_nd",
    _aten.index_select: "index_select", _aten.index: "index", _aten.gather: "gather",
    _aten.repeat: "repeat", _aten.repeat_interleave: "repeat_interleave",
    _aten.expand_copy: "expand_copy", _aten.flip: "flip", _aten.roll: "roll",
    _aten.slice_scatter: "slice_scatter", _aten.select_scatter: "select_scatter",
    _aten.as_strided_scatter: "as_strided_scatter", _aten.slice_backward: "slice_backward",
    _aten.select_backward: "select_backward", _aten.index_put_: "index_put_",
    _aten.index_put: "index_put", _aten._unsafe_index_put: "index_put",
    _aten.zero_: "zero_ (memset)", _aten.fill_: "fill_ (memset)",
    _aten.zeros: "zeros (memset)", _aten.new_zeros: "new_zeros (memset)",
    _aten.zeros_like: "zeros_like (memset)", _aten.full: "full (memset)",
    _aten.new_full: "new_full (memset)", _aten.full_like: "full_like (memset)",
}

_PACKAGE = str(Path(overlap_runtime.__file__).resolve().parent) + os.sep
_TRITON_SPEC = importlib.util.find_spec("triton")
#: the triton package's own directory (its CPU interpreter's argument copies are skipped)
_TRITON = (None if _TRITON_SPEC is None or not _TRITON_SPEC.origin
           else str(Path(_TRITON_SPEC.origin).resolve().parent) + os.sep)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@dataclass(frozen=True)
class CopyRecord:
    """One copy-kind op: ``phase`` ``"forward"`` or ``"backward"``, ``op`` its kind in
    ``COPY_OPS``, ``nbytes`` the bytes of its output, ``where`` the package line(s)."""

    phase: str
    op: str
    nbytes: int
    where: str


def _short(filename: str, line: int, name: str) -> str:
    return f"{filename[len(_PACKAGE):]}:{line} {name}"


def _where(frames: Iterable[tuple[str, int, str]]) -> str | None:
    """Innermost package frame, plus the innermost ``layers/`` frame when it is another file.
    ``frames`` outermost first; None when no frame is in the package."""
    inside = [(f, ln, n) for f, ln, n in frames if f.startswith(_PACKAGE)]
    if not inside:
        return None
    text = _short(*inside[-1])
    if not inside[-1][0].startswith(_PACKAGE + "layers" + os.sep):
        layer = [fr for fr in inside if fr[0].startswith(_PACKAGE + "layers" + os.sep)]
        if layer:
            text += " < " + _short(*layer[-1])
    return text


def _nbytes(out: Any) -> int:
    flat, _ = tree_flatten(out)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


class CopyCounter(TorchDispatchMode):
    """Records every ``COPY_OPS`` op as a :class:`CopyRecord` in ``self.records``.

    Set ``phase`` before each part (``"forward"``, ``"backward"``). For backward attribution run
    under ``torch.autograd.set_detect_anomaly(True, check_nan=False)`` (``layer_copies`` does):
    a built-in backward formula is then attributed to its node's forward stack.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CopyRecord] = []
        self.phase = "forward"

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # off while compiling, on while compiled runs
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        kind = COPY_OPS.get(func.overloadpacket)
        if kind is not None:
            self._record(kind, out)
        return out

    def _record(self, kind: str, out: Any) -> None:
        stack = traceback.extract_stack()
        if _TRITON and any(fr.filename.startswith(_TRITON) for fr in stack):
            return  # the CPU interpreter moving a kernel's arguments
        where = _where((fr.filename, fr.lineno or 0, fr.name) for fr in stack)
        if where is None:
            node = torch._C._current_autograd_node()
            if node is not None:
                formatted = (node.metadata or {}).get("traceback_", [])
                frames = [(m.group(1), int(m.group(2)), m.group(3))
                          for m in _FRAME.finditer("".join(formatted))]
                fwd = _where(frames)
                where = f"bwd of {node.name()} @ {fwd}" if fwd else f"bwd of {node.name()}"
            else:
                where = "(outside overlap_runtime)"
        self.records.append(CopyRecord(self.phase, kind, _nbytes(out), where))


def summarize(records: Iterable[CopyRecord]) -> dict[tuple[str, str, str], list[int]]:
    """``(phase, op, where) -> [bytes, count]``."""
    rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        row = rows[(r.phase, r.op, r.where)]
        row[0] += r.nbytes
        row[1] += 1
    return dict(rows)


def totals(records: Iterable[CopyRecord]) -> dict[str, int]:
    """Bytes per phase (``forward``, ``backward``)."""
    out: dict[str, int] = defaultdict(int)
    for r in records:
        out[r.phase] += r.nbytes
    return dict(out)


# -- the layers --------------------------------------------------------------------------------
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _build(args: argparse.Namespace, kind: str) -> tuple[torch.nn.Module, Callable[[torch.Tensor],
                                                                               torch.Tensor]]:
    from overlap_runtime.layers import compile as layer_compile
    from overlap_runtime.layers.attention import Qwen3_5Attention
    from overlap_runtime.layers.gated_deltanet import GatedDeltaNet

    dtype, device = _DTYPES[args.dtype], torch.device(args.device)
    if kind == "gdn":
        layer = GatedDeltaNet(args.hidden, args.key_heads, args.value_heads, args.head_dim,
                              args.head_dim, backend=args.gdn_backend,
                              conv_backend=args.conv_backend)
    else:
        layer = Qwen3_5Attention(args.hidden, args.attn_heads, args.kv_heads, args.head_dim,
                                 partial_rotary_factor=0.25, backend=args.attn_backend)
    layer = layer.to(device=device, dtype=dtype)
    if args.compile == "on":
        layer_compile.compile_elementwise(layer)
    if kind == "gdn":
        return layer, layer
    return layer, lambda x: layer(x, torch.arange(x.shape[1], device=x.device))


def layer_copies(args: argparse.Namespace, kind: str, tokens: int) -> list[CopyRecord]:
    """Forward + backward of one ``kind`` (``"gdn"`` / ``"attention"``) layer at ``tokens``
    (``args.batch`` rows) under :class:`CopyCounter`, after one unrecorded warm-up pass
    (compilation, lazy imports); returns the records."""
    torch.manual_seed(0)
    layer, call = _build(args, kind)
    dtype, device = _DTYPES[args.dtype], torch.device(args.device)

    def step(counter: CopyCounter | None) -> None:
        x = torch.randn(args.batch, tokens, args.hidden, device=device, dtype=dtype,
                        requires_grad=True)
        dy = torch.randn(args.batch, tokens, args.hidden, device=device, dtype=dtype)
        if counter is None:
            call(x).backward(dy)
            return
        with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
            out = call(x)
            counter.phase = "backward"
            out.backward(dy)

    step(None)
    layer.zero_grad(set_to_none=True)
    counter = CopyCounter()
    step(counter)
    return counter.records


def _fit(small: dict, large: dict, t0: int, target: int) -> dict:
    """Per row ``a + b * T`` through (t0, small), (2 t0, large), evaluated at ``target``."""
    out = {}
    for key in set(small) | set(large):
        b0, c0 = small.get(key, [0, 0])
        b1, c1 = large.get(key, [0, 0])
        slope = (b1 - b0) / t0
        out[key] = [int(round(b0 + slope * (target - t0))), max(c0, c1)]
    return out


def _print(title: str, rows: dict, top: int) -> dict[str, int]:
    print(f"\n{title}")
    print(f"{'phase':<9} {'op':<22} {'MB':>10} {'count':>5}  where")
    by_phase: dict[str, int] = defaultdict(int)
    ordered = sorted(rows.items(), key=lambda kv: (kv[0][0] != "forward", -kv[1][0]))
    for i, ((phase, op, where), (nbytes, count)) in enumerate(ordered):
        by_phase[phase] += nbytes
        if i < top or top <= 0:
            print(f"{phase:<9} {op:<22} {nbytes / 1e6:>10.3f} {count:>5}  {where}")
    for phase in ("forward", "backward"):
        print(f"total {phase}: {by_phase.get(phase, 0) / 1e6:.3f} MB")
    return dict(by_phase)


def main(argv: list[str] | None = None) -> None:
    """CLI (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", choices=("gdn", "attention", "both"), default="both")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--scale-to", type=int, default=0,
                   help="also run at 2 x --tokens and extrapolate every row to this T")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--key-heads", type=int, default=4)
    p.add_argument("--value-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--attn-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--gdn-backend", choices=("eager", "triton"), default="eager")
    p.add_argument("--conv-backend", choices=("torch", "triton"), default="torch")
    p.add_argument("--attn-backend", default="math")
    p.add_argument("--compile", choices=("on", "off"), default="off")
    p.add_argument("--top", type=int, default=25, help="rows printed per layer (0: all)")
    args = p.parse_args(argv)
    kinds = ("gdn", "attention") if args.layer == "both" else (args.layer,)
    for kind in kinds:
        small = summarize(layer_copies(args, kind, args.tokens))
        head = (f"{kind} layer, hidden {args.hidden}, {args.dtype}, {args.device}, "
                f"compile {args.compile}")
        if kind == "gdn":
            head += f", gdn {args.gdn_backend}, conv {args.conv_backend}"
        if args.scale_to:
            large = summarize(layer_copies(args, kind, 2 * args.tokens))
            rows = _fit(small, large, args.tokens, args.scale_to)
            head += (f": B={args.batch} x T={args.scale_to} extrapolated from T={args.tokens}, "
                     f"{2 * args.tokens}")
        else:
            rows = small
            head += f": B={args.batch} x T={args.tokens}"
        _print(head, rows, args.top)


if __name__ == "__main__":
    main()
