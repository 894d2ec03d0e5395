"""Registers and spills of our Triton kernels on sm_90, compiled ahead of time on a CPU (no GPU).

    python -m benchmarks.ptxas_report --workload gdn
    python -m benchmarks.ptxas_report --workload gdn_varlen
    python -m benchmarks.ptxas_report --workload conv
    python -m benchmarks.ptxas_report --workload walks
    python -m benchmarks.ptxas_report --workload gdn_fused

(1) A child process runs the workload under ``TRITON_INTERPRET=1`` with
``InterpretedFunction.run`` wrapped (the interpreter replaces each ``@triton.jit`` kernel by an
``InterpretedFunction`` holding the Python function; an ``Autotuner`` calls its ``run``) and
records each launch: kernel (module and name), argument types (:func:`arg_type`: ``*bf16``,
``*fp32``, ``*i32`` ..., ``i32`` / ``i64``, ``fp32``, ``u1``), scalar values, constexprs and
launch options, deduplicated. (2) This process (no interpreter) imports each kernel, takes its
``triton.autotune`` configs (the interpreter has one: ``ops/gdn/triton/common.py``;
``OVERLAP_RUNTIME_GDN_AUTOTUNE=all`` is set here), specialises the arguments with triton's own
binder (pointers as 16-byte aligned mock tensors when they were; ints by value: ``== 1`` becomes
a constexpr, multiples of 16 get ``tt.divisibility``), compiles for ``GPUTarget("cuda", 90,
32)`` and runs the venv's ``ptxas-blackwell -arch=sm_90a -v`` on the PTX (its plain ``ptxas`` is
too old for triton 3.9's PTX). One markdown row per launch and config: registers, spill stores /
loads and stack frame per thread (bytes), shared memory per block (``metadata.shared``).

The workloads run bf16 where the GPU would, with the production head dims (K = V = 128) and a
tiny T, so that the pointer dtypes and constexprs (block sizes, K, V, flags) are the production
ones; int arguments keep this run's values (their divisibility by 16 can differ at other sizes).
Caveats: the venv's triton (3.9, compiling with FP fusion on as 3.6 does) is not
the GPU's (3.6): code generation, hence the counts, can differ slightly. This is ptxas's static
allocation, not a profile: what a spill costs depends on where it sits.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"
_MARK = "LAUNCHES "
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
           "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
           "bool": "u1"}


def arg_type(value: Any) -> str:
    """Triton signature type of one runtime (non-constexpr) kernel argument: a tensor ->
    ``"*" + dtype`` (``*bf16``, ``*fp32``, ``*i32``, ...), a bool -> ``u1``, an int -> ``i32``
    (in int32 range) / ``i64`` / ``u64``, a float -> ``fp32``. Raises naming the value otherwise."""
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        if -2**31 <= value < 2**31:
            return "i32"
        if -2**63 <= value < 2**63:
            return "i64"
        if 0 <= value < 2**64:
            return "u64"
        raise ValueError(f"int argument {value} does not fit 64 bits")
    if isinstance(value, float):
        return "fp32"
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "data_ptr"):
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"tensor argument of dtype {dtype}: no triton pointer type known "
                             f"(known: {sorted(_DTYPES)})")
        return "*" + _DTYPES[name]
    raise TypeError(f"kernel argument {value!r} ({type(value).__name__}): expected a tensor, "
                    "int, float or bool")


@dataclass(frozen=True)
class Arg:
    """One runtime argument as recorded: its type, the value of a scalar, and for a pointer
    whether its address was 16-byte aligned."""

    type: str
    value: int | float | bool | None = None
    aligned: bool = True


def describe_arg(value: Any) -> Arg:
    """The :class:`Arg` of a runtime argument (a tensor's address is read, not its data)."""
    ty = arg_type(value)
    return Arg(ty, None, value.data_ptr() % 16 == 0) if ty.startswith("*") else Arg(ty, value)


@dataclass
class Launch:
    """One kernel launch: ``kernel`` is ``module:name``; ``options`` the launch options
    (num_warps, num_stages, ...) it was given."""

    kernel: str
    args: dict[str, Arg]
    constexprs: dict[str, Any]
    options: dict[str, Any]

    def key(self) -> str:  # (kernel, signature, constexprs, options)
        sig = [(n, a.type) for n, a in self.args.items()]
        return json.dumps([self.kernel, sig, self.constexprs, self.options], sort_keys=True)

    @staticmethod
    def from_json(d: dict) -> "Launch":
        return Launch(**{**d, "args": {n: Arg(**a) for n, a in d["args"].items()}})


def record_launch(fn: Callable, args: tuple, kwargs: Mapping[str, Any]) -> Launch:
    """The :class:`Launch` of the kernel's Python function ``fn`` called with ``args`` and
    ``kwargs`` (kernel arguments, then launch options by name); ``tl.constexpr`` parameters and
    ``None`` arguments (triton makes them constexprs) go to ``constexprs``; defaults apply."""
    sig = inspect.signature(fn)
    names = set(sig.parameters)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    launch_args: dict[str, Arg] = {}
    constexprs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if "constexpr" in str(sig.parameters[name].annotation) or value is None:
            value = value.value if type(value).__name__ == "constexpr" else value
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise TypeError(f"constexpr {name}={value!r}: only None, bool, int, float and "
                                "str are recorded")
            constexprs[name] = value
        else:
            launch_args[name] = describe_arg(value)
    options = {k: v for k, v in kwargs.items() if k not in names and v is not None}
    return Launch(f"{fn.__module__}:{fn.__qualname__}", launch_args, constexprs, options)


# The workloads: forward + backward on the CPU under the interpreter (bf16, production K, V, C).

def _gdn_case(heads: int, value_heads: int, cu: list[int] | None, options: Any) -> None:
    import torch
    import torch.nn.functional as F

    from overlap_runtime.ops.gdn import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    t, dim, states = (cu[-1] if cu else 128), 128, (len(cu) - 1 if cu else 1)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    q, k, v = randn(1, t, heads, dim), randn(1, t, heads, dim), randn(1, t, value_heads, dim)
    g = F.logsigmoid(randn(1, t, value_heads, dtype=torch.float32) + 2)  # fp32 log decay
    beta = torch.sigmoid(randn(1, t, value_heads))
    h0 = randn(states, value_heads, dim, dim, dtype=torch.float32)
    offsets = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True, use_qk_l2norm=True,
                                      backend="triton", cu_seqlens=offsets, options=options)
    torch.autograd.backward([o, state], [torch.randn_like(o), torch.randn_like(state)])


def run_gdn(varlen: bool) -> None:
    """GDN forward + backward, K = V = 128, H = 2 with HV = 4 and HV = 2, l2norm, initial and
    final state; dense T = 128, or 3 packed documents in T = 256. Also, with HV = 4,
    ``num_segments=2, recompute_w=True``: the segmented scan (summaries, chain) that long
    sequences take on a GPU, and the w-only ``wy_fwd``."""
    from overlap_runtime.ops.gdn import GDNKernelOptions

    cu = [0, 40, 200, 256] if varlen else None
    for heads, value_heads in ((2, 4), (2, 2)):
        _gdn_case(heads, value_heads, cu, None)
    _gdn_case(2, 4, cu, GDNKernelOptions(num_segments=2, recompute_w=True))


def run_gdn_fused() -> None:
    """The fused forward's walks (ops/gdn/triton/fused_fwd.py; its prep is the chain's
    kernels), K = V = 128, H = 2 / HV = 4, dense T = 128: alone (nothing saved) and through the
    backward (the saved set), with 2 segments (summary launch + walk); the default launch
    choices, 4 and 8 warps, 1 and 2 stages, column blocks of 32, 64 and 128."""
    import torch

    from overlap_runtime.ops.gdn import GDNKernelOptions
    from overlap_runtime.ops.gdn.triton.function import gdn_forward
    from overlap_runtime.ops.gdn.triton.fused_fwd import FusedConfig

    _gdn_case(2, 4, None, GDNKernelOptions(num_segments=2, fused_forward=True))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 128, 2, 128, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, 128, 4, 128, generator=gen).bfloat16()
    g = -torch.rand(1, 128, 4, generator=gen)
    beta = torch.rand(1, 128, 4, generator=gen).bfloat16()
    for config in (FusedConfig(), FusedConfig(walk_warps=8, summary_warps=8),
                   FusedConfig(walk_stages=2), FusedConfig(block=32),
                   FusedConfig(block=128)):
        gdn_forward(q, k, v, g, beta, None, 128 ** -0.5, True, 2, fused=True, save=False,
                    fused_config=config)


def run_conv() -> None:
    """Causal conv + SiLU forward + backward, bf16, B = 1, T = 128, C = 256, K = 4, with and
    without doc_positions and left (every combination)."""
    import torch

    from overlap_runtime.ops.causal_conv import causal_conv_silu_triton

    gen = torch.Generator().manual_seed(0)
    t, c, width = 128, 256, 4
    pos = torch.cat([torch.arange(50), torch.arange(t - 50)])[None]  # two documents
    for positions in (None, pos):
        for with_left in (False, True):
            x = torch.randn(1, t, c, generator=gen).to(torch.bfloat16).requires_grad_()
            w = torch.randn(c, width, generator=gen).to(torch.bfloat16).requires_grad_()
            left = (torch.randn(1, width - 1, c, generator=gen).to(torch.bfloat16)
                    .requires_grad_() if with_left else None)
            y = causal_conv_silu_triton(x, w, left, 1, positions)
            y.backward(torch.randn_like(y))


def run_walks() -> None:
    """The forward walks of benchmarks/gdn_walks.py, bf16, K = V = 128, H = HV = 2, T = 128:
    the library's one-walk launch and the experimental ``[64, BV]``-block kernel (after the
    library's prepare kernels, which make their inputs)."""
    import torch

    from benchmarks import gdn_walks
    x = gdn_walks.prepared(128, 2, 128, torch.bfloat16, torch.device("cpu"))
    for name in ("lib", "split"):
        gdn_walks.run_variant(name, x)[0]()


WORKLOADS: dict[str, Callable[[], None]] = {
    "gdn": lambda: run_gdn(False), "gdn_varlen": lambda: run_gdn(True), "conv": run_conv,
    "walks": run_walks, "gdn_fused": run_gdn_fused}


def capture(workload: Callable[[], None]) -> list[Launch]:
    """Run ``workload`` with every interpreted launch recorded (needs ``TRITON_INTERPRET=1``
    set before triton was imported); unique launches in first-launch order."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("capture needs TRITON_INTERPRET=1 set before triton is imported")
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, Launch] = {}
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        launch = record_launch(self.fn, args, kwargs)
        seen.setdefault(launch.key(), launch)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        workload()
    finally:
        InterpretedFunction.run = original
    return list(seen.values())


def capture_in_child(workload: str, timeout_s: float = 1800) -> list[Launch]:
    """:func:`capture` of ``WORKLOADS[workload]`` in a child process under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ptxas_report", "--capture",
                           workload], env=env,
                          capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"workload {workload!r} failed under the interpreter:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)][-1]
    return [Launch.from_json(d) for d in json.loads(line[len(_MARK):])]


@dataclass(frozen=True)
class Row:
    """ptxas's figures for one compiled kernel (bytes per thread; shared per block)."""

    kernel: str
    constexprs: str
    num_warps: int
    num_stages: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int

    HEADER = ("| kernel | constexprs | warps | stages | registers | spill stores (B) "
              "| spill loads (B) | stack (B) | shared (B) |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|")

    def markdown(self) -> str:
        stores, loads = (f"**{n}**" if n else "0" for n in (self.spill_stores, self.spill_loads))
        return (f"| {self.kernel} | {self.constexprs} | {self.num_warps} | {self.num_stages} | "
                f"{self.registers} | {stores} | {loads} | {self.stack} | {self.shared} |")


def short_constexprs(constexprs: Mapping[str, Any]) -> str:
    """``K=128 BV=64 VARLEN=F ...`` (bools as T/F, None as -)."""
    def show(v: Any) -> str:
        if v is None or isinstance(v, bool):
            return {True: "T", False: "F", None: "-"}[v]
        return f"{v:g}" if isinstance(v, float) else str(v)
    return " ".join(f"{k}={show(v)}" for k, v in constexprs.items())


def ptxas_path() -> Path:
    """The ``ptxas-blackwell`` shipped with the installed triton."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str, entry: str) -> tuple[int, int, int, int]:
    """``(registers, spill stores, spill loads, stack frame)`` of function ``entry`` from the
    output of ``ptxas -v``; raises naming the entry when ptxas reported none."""
    found: dict[str, list[int]] = {}
    current = None
    for line in text.splitlines():
        if m := _PROPS.search(line):
            current = m.group(1)
        elif current and (m := _FRAME.search(line)):
            stack, stores, loads = (int(x) for x in m.groups())
            found[current] = [0, stores, loads, stack]
        elif current and (m := _REGS.search(line)) and current in found:
            found[current][0] = int(m.group(1))
    if entry not in found or not found[entry][0]:
        raise RuntimeError(f"ptxas -v reported no registers for {entry!r}:\n{text}")
    return tuple(found[entry])  # type: ignore[return-value]


class _Pointer:
    """What triton's binder reads of a tensor argument: its dtype and address."""

    def __init__(self, dtype: Any, aligned: bool) -> None:
        self.dtype, self.address = dtype, 0 if aligned else 8

    def data_ptr(self) -> int:
        return self.address


def compile_report(fn: Any, args: Mapping[str, Arg], constexprs: Mapping[str, Any],
                   options: Mapping[str, Any]) -> Row:
    """Compile the JITFunction ``fn`` for sm_90a with these arguments, constexprs and launch
    options (``num_warps``, ``num_stages``, ...) and return ptxas's :class:`Row`."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    torch_dtype = {v: getattr(torch, k) for k, v in _DTYPES.items()}
    values = {n: _Pointer(torch_dtype[a.type[1:]], a.aligned) if a.type.startswith("*")
              else a.value for n, a in args.items()}
    kwargs = {"debug": False, "enable_fp_fusion": True, **options}  # fusion: triton 3.6's default
    bound, spec, opts = binder(**values, **constexprs, **kwargs)
    for param, (ty, _) in zip(fn.params, spec):
        want = args[param.name].type if param.name in args else "constexpr"
        if ty != want and not (ty == "constexpr" and args[param.name].value == 1):
            raise RuntimeError(f"{fn.__name__}.{param.name}: recorded type {want}, triton's "
                               f"binder says {ty}")
    options_, signature, consts, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=target,
                            options=options_.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        out = subprocess.run([str(ptxas_path()), f"-arch={ARCH}", "-v", "k.ptx", "-o", "k.cubin"],
                             cwd=tmp, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed on {fn.__name__}:\n{out.stderr[-4000:]}")
    regs, stores, loads, stack = parse_ptxas(out.stdout + out.stderr, kernel.metadata.name)
    return Row(fn.__name__, short_constexprs(constexprs), kernel.metadata.num_warps,
               kernel.metadata.num_stages, regs, stores, loads, stack, kernel.metadata.shared)


def resolve(kernel: str) -> tuple[Any, list[Any] | None]:
    """``(JITFunction, autotune configs or None)`` of ``module:name`` (no interpreter here)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    module, name = kernel.split(":")
    obj = getattr(importlib.import_module(module), name)
    configs = None
    while not isinstance(obj, JITFunction):
        if isinstance(obj, Autotuner) and configs is None:
            configs = list(obj.configs)
        obj = obj.fn
    return obj, configs


def report(launches: list[Launch]) -> list[Row]:
    """One row per launch and autotune config (or the launch's own options), compiled here."""
    rows = []
    for launch in launches:
        fn, configs = resolve(launch.kernel)
        variants = [(launch.constexprs, launch.options)]
        if configs:
            variants = [({**launch.constexprs, **cfg.kwargs},
                         {k: v for k, v in cfg.all_kwargs().items() if k not in cfg.kwargs})
                        for cfg in configs]
        for constexprs, options in variants:
            rows.append(compile_report(fn, launch.args, constexprs, options))
            print("compiled", rows[-1].markdown(), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--workload", choices=sorted(WORKLOADS))
    mode.add_argument("--capture", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.capture:  # the child: interpreter already on (set by capture_in_child)
        print(_MARK + json.dumps([asdict(x) for x in capture(WORKLOADS[a.capture])]))
        return
    os.environ["OVERLAP_RUNTIME_GDN_AUTOTUNE"] = "all"
    import triton

    launches = capture_in_child(a.workload)
    print(f"workload {a.workload}: {len(launches)} unique launches; triton {triton.__version__}, "
          f"{ptxas_path().name} -arch={ARCH} -v\n")
    print(Row.HEADER)
    for row in report(launches):
        print(row.markdown())


if __name__ == "__main__":
    main()
