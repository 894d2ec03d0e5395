"""The GDN forward state walk alone: the library's kernel against experimental variants, to pick
the next walk design with one GPU call (issue #22: our walk's step is ~1.6x fla's).

Usage (on the H200, wheels as gpu/README.md says):
    PYTHONPATH=$PWD python3 -m benchmarks.gdn_walks [--seq-len 32768] [--heads 32]
    PYTHONPATH=. TRITON_INTERPRET=1 python -m benchmarks.gdn_walks --check   # CPU, small

Every variant walks the chunks of each (batch, value head) from a zero state in the state mode of
``fwd_scan_kernel`` (function.py): ``v_new = u - w h`` (stored), ``h <- e^gamma_C h + Ktail^T
v_new``, the state entering each chunk stored in the input dtype, the last one in fp32. Inputs
come from the library's own ``prepare`` (normalised k, w, u, gamma of random q, k, v, g, beta;
B = 1, H = HV, K = V = 128, bf16).

Variants (each in its own child process: a kernel that faults loses its CUDA context, not the
rest of the table):

- ``lib``: ``state_scan`` with one segment (one walk of all chunks, ``BV = 64``), the
  library's kernel as it runs when a sequence is not split.
- ``lib_segmented``: the library's default forward scan as ``gdn_forward`` runs it (segment
  summaries, chain, walks from the true entering states; ``choose_segments``).
- ``lib_bv32``: the library's kernel, one walk, launched with ``BV = 32`` (4 column blocks per
  head: twice the programs). The whole op with this block hit an illegal memory access on the
  H200 (docs/benchmarks.md); this row says whether the walk is where.
- ``split``: an experimental kernel (:func:`walk_split_kernel`, here only) holding the state
  as ``K / 64`` row blocks of ``[64, BV]`` fp32 (one warpgroup's accumulator shape) with the
  products split to match, and autotuned over ``BV`` in {32, 64}, 2 or 4 warps, 2 or 3 stages
  (the design space flash-linear-attention's walk tunes over; its code was read, not copied).

Reported per variant: the median of ``do_bench`` (ms), the tuner's pick where there is one, and
rel-L2 of the stored states, v_new and the final state against ``lib`` (bf16 storage: <= 1e-2
expected; fp32 under ``--check``: <= 1e-5). ``$OUT/gdn_walks.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl


from overlap_runtime.ops.gdn.triton import function as fn  # noqa: E402
from overlap_runtime.ops.gdn.triton.common import CHUNK, INTERPRET, mm, mma  # noqa: E402
from overlap_runtime.ops.gdn.triton.fwd_state import fwd_scan_kernel  # noqa: E402
from overlap_runtime.testing import rel_l2  # noqa: E402

VARIANTS = ("lib", "lib_segmented", "lib_bv32", "split")


def _split_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BV": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=s)
            for bv in (32, 64) for w in (2, 4) for s in (2, 3)]


@triton.autotune(configs=_split_configs(), key=["K", "V"])
@triton.jit
def walk_split_kernel(k, w, u, gamma, states, v_new, h_end, T, NT, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr):
    """Grid ``(V / BV, B * HV)``; K is 64 or 128 (one or two ``[64, BV]`` state blocks)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, 64)
    o_v = i_v * BV + tl.arange(0, BV)
    DT = k.dtype.element_ty
    b_h1 = tl.zeros([64, BV], dtype=tl.float32)
    if K == 128:
        b_h2 = tl.zeros([64, BV], dtype=tl.float32)
    for n in range(NT):
        o_t = n * BT + tl.arange(0, BT)
        m_t = o_t < T
        base = ((i_b * NT + n) * HV + i_hv).to(tl.int64) * (K * V)
        tl.store(states + base + o_c[:, None] * V + o_v[None, :], b_h1.to(DT))
        if K == 128:
            tl.store(states + base + (64 + o_c)[:, None] * V + o_v[None, :], b_h2.to(DT))
        row_w = ((i_b * T + o_t) * HV + i_hv) * K
        b_w = tl.load(w + row_w[:, None] + o_c[None, :], mask=m_t[:, None], other=0.0)
        b_wh = mm(b_w, b_h1.to(DT))
        if K == 128:
            b_w2 = tl.load(w + row_w[:, None] + 64 + o_c[None, :], mask=m_t[:, None], other=0.0)
            b_wh = mma(b_w2, b_h2.to(DT), b_wh)
        off_v = ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(u + off_v, mask=m_t[:, None], other=0.0).to(tl.float32) - b_wh
        tl.store(v_new + off_v, b_v.to(v_new.dtype.element_ty), mask=m_t[:, None])
        b_gam = tl.load(gamma + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0.0)
        g_last = tl.load(gamma + (i_b * T + tl.minimum(n * BT + BT, T) - 1) * HV + i_hv)
        b_vs = (b_v * tl.where(m_t, tl.exp(g_last - b_gam), 0.0)[:, None]).to(DT)
        decay = tl.exp(g_last)
        row_k = ((i_b * T + o_t) * H + i_h) * K
        b_kt = tl.load(k + row_k[None, :] + o_c[:, None], mask=m_t[None, :], other=0.0)
        b_h1 = mma(b_kt, b_vs, b_h1 * decay)
        if K == 128:
            b_kt2 = tl.load(k + row_k[None, :] + 64 + o_c[:, None], mask=m_t[None, :], other=0.0)
            b_h2 = mma(b_kt2, b_vs, b_h2 * decay)
    o_e = (i_bh * K + o_c[:, None]) * V + o_v[None, :]
    tl.store(h_end + o_e, b_h1)
    if K == 128:
        tl.store(h_end + o_e + 64 * V, b_h2)


def prepared(seq_len: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device,
             seed: int = 0) -> dict[str, torch.Tensor]:
    """Normalised k, w, u, gamma from the library's ``prepare`` on random inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = randn(1, seq_len, heads, dim).to(dtype)
    k = randn(1, seq_len, heads, dim).to(dtype)
    v = randn(1, seq_len, heads, dim).to(dtype)
    g = torch.nn.functional.logsigmoid(randn(1, seq_len, heads) + 2.0)
    beta = torch.sigmoid(randn(1, seq_len, heads)).to(dtype)
    prep = fn.prepare(q, k, v, g, beta, True)
    return {"k": prep["kn"], "w": prep["w"], "u": prep["u"], "gamma": prep["gamma"]}


def run_variant(name: str, x: dict[str, torch.Tensor]):
    """A closure running variant ``name`` on ``x`` and returning ``(states, v_new, h_end)``
    (h_end ``[B * HV, K, V]`` fp32), and the tuner's pick (a callable, after a first run)."""
    k, w, u, gamma = x["k"], x["w"], x["u"], x["gamma"]
    batch, seq_len, heads, key_dim = k.shape
    value_heads, value_dim = u.shape[2], u.shape[3]
    num_chunks = triton.cdiv(seq_len, CHUNK)
    bh = batch * value_heads

    if name == "lib":
        def call():
            states, v_new, h_end = fn.state_scan(k, w, u, gamma, None, 1, num_chunks)
            return states, v_new, h_end[:, 0]
        return call, lambda: str(next(iter(fwd_scan_kernel.cache.values()), None))
    if name == "lib_segmented":
        ns, per = fn._layout(k, u, None, 1)

        def call():
            if ns == 1:
                states, v_new, h_end = fn.state_scan(k, w, u, gamma, None, 1, num_chunks)
                return states, v_new, h_end[:, 0]
            m, s = fn.segment_summaries(k, w, u, gamma, ns, per)
            final, seg_init = fn.chain(m, s, None, store_segments=True)
            states, v_new, _ = fn.state_scan(k, w, u, gamma, seg_init, ns, per)
            return states, v_new, final
        return call, lambda: f"{ns} segments of {per} chunks"
    if name in ("lib_bv32", "split"):
        def call():
            states = torch.empty(batch, num_chunks, value_heads, key_dim, value_dim,
                                 device=k.device, dtype=k.dtype)
            v_new = torch.empty_like(u)
            h_end = torch.empty(bh, key_dim, value_dim, device=k.device, dtype=torch.float32)
            if name == "lib_bv32":
                fwd_scan_kernel[(value_dim // 32, 1, bh)](
                    k, w, u, gamma, h_end, states, v_new, h_end, h_end, h_end, h_end, h_end,
                    seq_len, num_chunks, num_chunks, 1, H=heads, HV=value_heads, K=key_dim,
                    V=value_dim, BT=CHUNK, BV=32, SUMMARY=False, HAS_INIT=False, STORE=True,
                    VARLEN=False)
            else:
                walk_split_kernel[lambda meta: (value_dim // meta["BV"], bh)](
                    k, w, u, gamma, states, v_new, h_end, seq_len, num_chunks, H=heads,
                    HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK)
            return states, v_new, h_end
        kernel = fwd_scan_kernel if name == "lib_bv32" else walk_split_kernel
        return call, lambda: str([str(c) for c in kernel.cache.values()])
    raise ValueError(f"unknown variant {name!r}: one of {VARIANTS}")


def measure(name: str, seq_len: int, heads: int) -> dict:
    """One variant on the GPU: median ms, tuner pick, rel-L2 against ``lib``."""
    from triton.testing import do_bench

    device = torch.device("cuda")
    x = prepared(seq_len, heads, 128, torch.bfloat16, device)
    ref = run_variant("lib", x)[0]()
    call, pick = run_variant(name, x)
    got = call()
    torch.cuda.synchronize()
    ms = do_bench(call, warmup=25, rep=100, return_mode="median")
    errors = {t: rel_l2(a.float(), b.float()) for t, a, b in zip(("states", "v_new", "h_end"),
                                                                  got, ref)}
    return {"variant": name, "T": seq_len, "heads": heads, "ms": ms, "pick": pick(),
            "errors": errors}


def check() -> dict:
    """Under the interpreter: every variant against ``lib`` in fp32 at two small sizes."""
    out = {}
    for seq_len, dim in ((600, 64), (70, 128)):  # 600: two segments under the interpreter
        x = prepared(seq_len, 2, dim, torch.float32, torch.device("cpu"), seed=1)
        ref = run_variant("lib", x)[0]()
        for name in VARIANTS[1:]:
            got = run_variant(name, x)[0]()
            out[f"{name} T={seq_len} K=V={dim}"] = {
                t: rel_l2(a, b) for t, a, b in zip(("states", "v_new", "h_end"), got, ref)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--variant", choices=VARIANTS, help="run this one here (the driver's child)")
    p.add_argument("--check", action="store_true", help="interpreter check, no timing")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per child")
    args = p.parse_args()
    if args.check:
        print(json.dumps(check(), indent=1))
        return 0
    if args.variant:
        print("RESULT " + json.dumps(measure(args.variant, args.seq_len, args.heads)), flush=True)
        return 0
    rows = []
    for name in VARIANTS:
        cmd = [sys.executable, "-m", "benchmarks.gdn_walks", "--variant", name, "--seq-len", str(args.seq_len),
               "--heads", str(args.heads)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  cwd=str(Path(__file__).resolve().parents[1]))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = (json.loads(lines[-1][7:]) if lines else
                   {"variant": name, "error": (proc.stderr or proc.stdout)[-600:]})
        except subprocess.TimeoutExpired:
            row = {"variant": name, "error": f"timed out after {args.timeout} s"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\nforward walk, B=1 H=HV={args.heads} K=V=128 bf16, T={args.seq_len}")
    base = next((r["ms"] for r in rows if r["variant"] == "lib" and "ms" in r), None)
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:14} ERROR {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        worst = max(r["errors"].values())
        ratio = f"{r['ms'] / base:.2f}x lib" if base else ""
        print(f"{r['variant']:14} {r['ms']:8.3f} ms {ratio:>10}  max rel-L2 {worst:.1e}  "
              f"{r['pick']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gdn_walks.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
