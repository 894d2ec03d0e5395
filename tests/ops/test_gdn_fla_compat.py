"""The flash-linear-attention 0.6.0 drop-in: its signature (read from the wheel's source) and its
documented semantics on the eager backend, against the float64 recurrence (fp32 rel-L2 <= 1e-5)."""

from __future__ import annotations

import ast
import inspect
import os
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.gdn import make_inputs, rel_l2, upcast
from overlap_runtime.ops.gdn import recurrent_gated_delta_rule
from overlap_runtime.ops.gdn.fla_compat import DEFAULT_BACKEND, chunk_gated_delta_rule

NAMES = ("q", "k", "v", "g", "beta")
WHEEL_SOURCE = "fla/ops/gated_delta_rule/chunk.py"
OURS_ONLY = ("backend", "options")  # our keyword-only additions


def _wheel() -> Path | None:
    env = os.environ.get("OVERLAP_RUNTIME_FLA_WHEEL")
    path = Path(env) if env else (Path(__file__).resolve().parents[2] / ".whl"
                                  / "fla_core-0.6.0-py3-none-any.whl")
    return path if path.is_file() else None


def _fla_parameters(source: str) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of fla's public ``chunk_gated_delta_rule``, from its source."""
    tree = ast.parse(source)
    fn = next(node for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name == "chunk_gated_delta_rule")
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults]
    params = [(a.arg, "POSITIONAL_OR_KEYWORD", d) for a, d in zip(positional, defaults)]
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        params.append((a.arg, "KEYWORD_ONLY",
                       inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    if args.vararg is not None:
        params.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    if args.kwarg is not None:
        params.append((args.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return params


def test_signature_matches_the_wheel():
    wheel = _wheel()
    if wheel is None:
        pytest.skip("fla-core 0.6.0 wheel not found (.whl/ or OVERLAP_RUNTIME_FLA_WHEEL)")
    with zipfile.ZipFile(wheel) as z:
        fla = _fla_parameters(z.read(WHEEL_SOURCE).decode())
    ours = [(p.name, p.kind.name, p.default)
            for p in inspect.signature(chunk_gated_delta_rule).parameters.values()
            if p.name not in OURS_ONLY]
    assert ours == fla
    extra = [p for p in inspect.signature(chunk_gated_delta_rule).parameters.values()
             if p.name in OURS_ONLY]
    assert [p.kind for p in extra] == [inspect.Parameter.KEYWORD_ONLY] * len(OURS_ONLY)
    assert DEFAULT_BACKEND == "triton"


@pytest.fixture
def x():
    return make_inputs(2, 70, 2, 4, 8, 6, dtype=torch.float32)


def _ref(x, **kwargs):
    ref = upcast(x)
    return ref, recurrent_gated_delta_rule(*(ref[n] for n in NAMES), **kwargs)


def test_defaults_do_not_normalise_q_and_k(x):
    o, state = chunk_gated_delta_rule(*(x[n] for n in NAMES), backend="eager")
    assert state is None and o.dtype == torch.float32
    _, (o_plain, _) = _ref(x, use_qk_l2norm=False)
    _, (o_normed, _) = _ref(x, use_qk_l2norm=True)
    assert rel_l2(o, o_plain) <= 1e-5
    assert rel_l2(o_plain, o_normed) > 0.1  # the default would be caught
    o, _ = chunk_gated_delta_rule(*(x[n] for n in NAMES), use_qk_l2norm_in_kernel=True,
                                  backend="eager")
    assert rel_l2(o, o_normed) <= 1e-5


def test_final_state_and_dtypes_as_fla_returns_them(x):
    half = {n: x[n].detach().to(torch.bfloat16) for n in ("q", "k", "v", "beta")}
    h0 = x["initial_state"].detach().to(torch.bfloat16)  # fla accepts any float state and g
    o, state = chunk_gated_delta_rule(half["q"], half["k"], half["v"],
                                      x["g"].detach().to(torch.bfloat16), half["beta"],
                                      initial_state=h0, output_final_state=True, backend="eager")
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert state.shape == (2, 4, 8, 6)


def test_head_first_is_refused_as_fla_does(x):
    for value in (True, False):
        with pytest.raises(DeprecationWarning, match="head_first has been removed"):
            chunk_gated_delta_rule(*(x[n] for n in NAMES), head_first=value, backend="eager")


def test_packed_sequences_with_states_and_gradients():
    lengths = [40, 0, 75, 9]
    x = make_inputs(1, sum(lengths), 2, 4, 8, 6, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    x["initial_state"] = torch.randn(len(lengths), 4, 8, 6, generator=gen).requires_grad_(True)
    cu = torch.tensor([0] + lengths).cumsum(0)
    chunk_indices = torch.tensor([[0, 0], [2, 0], [2, 1], [3, 0]])
    o, h = chunk_gated_delta_rule(*(x[n] for n in NAMES), initial_state=x["initial_state"],
                                  output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu,
                                  chunk_indices=chunk_indices, backend="eager")
    ref = upcast(x)
    outs, finals = [], []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:
            finals.append(ref["initial_state"][n])
            continue
        o_n, h_n = recurrent_gated_delta_rule(*(ref[m][:, s:e] for m in NAMES),
                                              initial_state=ref["initial_state"][n:n + 1],
                                              use_qk_l2norm=False)
        outs.append(o_n)
        finals.append(h_n[0])
    o_ref, h_ref = torch.cat(outs, dim=1), torch.stack(finals)
    assert rel_l2(o, o_ref) <= 1e-5 and rel_l2(h, h_ref) <= 1e-5
    wanted = list(NAMES) + ["initial_state"]
    grads = torch.autograd.grad(o.sum() + (h * h).sum(), [x[n] for n in wanted])
    ref_grads = torch.autograd.grad(o_ref.sum() + (h_ref * h_ref).sum(), [ref[n] for n in wanted])
    for name, grad, ref_grad in zip(wanted, grads, ref_grads):
        assert rel_l2(grad, ref_grad) <= 1e-5, name
    args = [x[n].detach() for n in NAMES]
    with pytest.raises(ValueError, match="chunk_indices differs"):
        chunk_gated_delta_rule(*args, cu_seqlens=cu, chunk_indices=chunk_indices[:3],
                               backend="eager")
    with pytest.raises(ValueError, match="cu_seqlens_cpu=.* differs from cu_seqlens"):
        chunk_gated_delta_rule(*args, cu_seqlens=cu, cu_seqlens_cpu=cu.flip(0), backend="eager")
    with pytest.raises(ValueError, match="chunk_indices was given without cu_seqlens"):
        chunk_gated_delta_rule(*args, chunk_indices=chunk_indices, backend="eager")


def test_state_v_first_transposes_the_state(x):
    args = [x[n] for n in NAMES]
    h0 = x["initial_state"]
    _, h = chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True,
                                  backend="eager")
    _, h_vk = chunk_gated_delta_rule(*args, initial_state=h0.transpose(-1, -2),
                                     output_final_state=True, state_v_first=True, backend="eager")
    assert torch.equal(h_vk, h.transpose(-1, -2))
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        _, h_old = chunk_gated_delta_rule(*args, initial_state=h0.transpose(-1, -2),
                                          output_final_state=True, transpose_state_layout=True,
                                          backend="eager")
    assert torch.equal(h_old, h_vk)


def test_in_kernel_gate_and_beta_sigmoid(x):
    args = {n: x[n].detach() for n in NAMES}
    gen = torch.Generator().manual_seed(3)
    raw_g = torch.randn(args["g"].shape, generator=gen)
    a_log = (0.5 * torch.randn(4, generator=gen) - 1.0).requires_grad_(True)
    dt_bias = torch.randn(4, generator=gen)
    raw_beta = torch.randn(args["beta"].shape, generator=gen)
    o, _ = chunk_gated_delta_rule(args["q"], args["k"], args["v"], raw_g, raw_beta,
                                  use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                  backend="eager")
    g = -a_log.double().exp() * F.softplus(raw_g.double() + dt_bias.double())
    beta = 2 * torch.sigmoid(raw_beta.double())
    o_ref, _ = recurrent_gated_delta_rule(args["q"].double(), args["k"].double(),
                                          args["v"].double(), g, beta, use_qk_l2norm=False)
    assert rel_l2(o, o_ref) <= 1e-5
    (d_alog,) = torch.autograd.grad(o.sum(), [a_log])
    (d_alog_ref,) = torch.autograd.grad(o_ref.sum(), [a_log])
    assert rel_l2(d_alog, d_alog_ref) <= 1e-5


def test_chunk_size_keyword(x):
    args = [x[n].detach() for n in NAMES]
    o, _ = chunk_gated_delta_rule(*args, chunk_size=16, backend="eager")
    _, (o_ref, _) = _ref(x, use_qk_l2norm=False)
    assert rel_l2(o, o_ref) <= 1e-5
    with pytest.raises(ValueError, match="`chunk_size` must be 16, 32, or 64.*got 48"):
        chunk_gated_delta_rule(*args, chunk_size=48, backend="eager")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"use_qk_l2norm": True}, TypeError, r"unexpected keyword\(s\) \['use_qk_l2norm'\]"),
    ({"allow_neg_eigval": True}, ValueError, "requires `use_beta_sigmoid_in_kernel=True`"),
    ({"use_gate_in_kernel": True}, ValueError, "use_gate_in_kernel=True needs A_log"),
    ({"dt_bias": torch.zeros(4)}, ValueError, "dt_bias is used only with use_gate_in_kernel"),
    ({"cp_context": object()}, NotImplementedError, "overlap_runtime.context_parallel"),
    ({"state_v_first": True, "transpose_state_layout": True}, ValueError, "Cannot pass both"),
    ({"cu_seqlens": torch.tensor([0, 70])}, ValueError, "cu_seqlens needs B == 1"),
])
def test_refusals_name_the_rule(x, kwargs, error, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error, match=match):
            chunk_gated_delta_rule(*(x[n].detach() for n in NAMES), backend="eager", **kwargs)


def test_default_backend_is_triton_and_never_falls_back(x):
    # K = 8 is not a Triton head dim: the default names the rule instead of running eager
    with pytest.raises(NotImplementedError, match="backend='triton'.*no automatic fallback"):
        chunk_gated_delta_rule(*(x[n].detach() for n in NAMES))


def _fla_or_skip():
    """fla-core 0.6.0's ``chunk_gated_delta_rule`` with its Hopper guard lifted (its backward
    is refused on triton < 3.7.1 for a miscompile, gpu/README.md: this test compares against
    it, so a wrong fla gradient shows up as a failure here, never as a pass)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import triton.runtime.autotuner as autotuner

    # fla autotunes dozens of launch configurations per kernel and shape family (minutes of
    # compiles on first use): this comparison needs its results, not its speed, so fla's
    # kernels (decorated at import, below) keep their first configuration only.
    original = autotuner.Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kwargs):  # noqa: ANN001
        original(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config_only
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except Exception as error:  # noqa: BLE001 - say why
        pytest.skip(f"fla-core not importable: {type(error).__name__}: {error}")
    finally:
        autotuner.Autotuner.__init__ = original
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return fla_gdn


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("lengths", [None, (1, 63, 64, 65, 700, 1157)],
                         ids=["dense_B2_T2048", "packed_6_docs"])
def test_gpu_same_call_same_results_as_fla(lengths, l2):
    """The same call (bf16 q, k, v, beta; fp32 g; fp32 initial states; H=16 key heads, HV=32
    value heads, K=V=128) through the drop-in and through fla 0.6.0: o, the final state and
    every gradient within rel-L2 1e-2 of fla's, and within 1e-2 of the fp32 eager backend on
    the same bf16-valued inputs (the independent reference)."""
    fla_gdn = _fla_or_skip()
    dev = torch.device("cuda")
    batch, t = (2, 2048) if lengths is None else (1, sum(lengths))
    states = batch if lengths is None else len(lengths)
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    def qk() -> torch.Tensor:  # unit rows when the op does not normalise (else the recurrence
        raw = randn(batch, t, 16, 128)  # with |k|^2 = 128 diverges: NaN in fp32 as in bf16)
        return (raw if l2 else F.normalize(raw, dim=-1)).bfloat16()

    x = {"q": qk(), "k": qk(),
         "v": randn(batch, t, 32, 128).bfloat16(),
         "g": F.logsigmoid(randn(batch, t, 32) + 2.0),
         "beta": torch.sigmoid(randn(batch, t, 32)).bfloat16(),
         "initial_state": randn(states, 32, 128, 128) * 0.1}
    cu = None if lengths is None else torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    do = randn(batch, t, 32, 128).bfloat16()
    dh = randn(states, 32, 128, 128)

    def run(fn, inputs, **extra):
        leaves = {n: v.detach().clone().requires_grad_() for n, v in inputs.items()}
        o, h = fn(*(leaves[n] for n in NAMES), initial_state=leaves["initial_state"],
                  output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, **extra)
        torch.autograd.backward((o, h), (do.to(o.dtype), dh.to(h.dtype)))
        out = {"o": o.detach().float(), "state": h.detach().float()}
        out.update({"d" + n: v.grad.float() for n, v in leaves.items()})
        return out

    ours = run(chunk_gated_delta_rule, x)
    theirs = run(fla_gdn, x)
    ref = run(chunk_gated_delta_rule, {n: v.float() for n, v in x.items()}, backend="eager")
    errors = {n: (rel_l2(ours[n], theirs[n]), rel_l2(ours[n], ref[n]), rel_l2(theirs[n], ref[n]))
              for n in ours}
    assert all(bool(torch.isfinite(v).all()) for v in ours.values())
    assert all(a <= 1e-2 and b <= 1e-2 for a, b, _ in errors.values()), errors
