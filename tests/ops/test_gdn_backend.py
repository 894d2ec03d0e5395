"""Backend dispatch and input validation of chunk_gated_delta_rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support.gdn import make_inputs, rel_l2
from overlap_runtime.ops.gdn import (
    SUPPORTED_BACKENDS,
    EagerBackend,
    GDNBackend,
    TritonBackend,
    chunk_gated_delta_rule,
    get_backend,
    recurrent_gated_delta_rule,
)

NAMES = ("q", "k", "v", "g", "beta")


@pytest.fixture
def inputs():
    return make_inputs(2, 10, 2, 4, 8, 6, dtype=torch.float32, requires_grad=False)


def _call(inputs, **overrides):
    args = {**{n: inputs[n] for n in NAMES}, **overrides}
    return chunk_gated_delta_rule(**args)


def test_supported_backends_and_registry():
    assert SUPPORTED_BACKENDS == ("eager", "triton")
    assert isinstance(get_backend("eager"), EagerBackend)
    assert isinstance(get_backend("triton"), TritonBackend)
    assert all(isinstance(get_backend(n), GDNBackend) for n in SUPPORTED_BACKENDS)


@pytest.mark.parametrize("name", ["auto", "Eager", "cuda", ""])
def test_unknown_backend_names_itself_and_the_supported_set(inputs, name):
    with pytest.raises(ValueError) as info:
        _call(inputs, backend=name)
    message = str(info.value)
    assert repr(name) in message and "'eager'" in message and "'triton'" in message


def test_triton_raises_not_implemented_without_fallback(inputs):
    # K=8 on the CPU: the Triton backend names the unsupported capability and never falls back
    with pytest.raises(NotImplementedError, match="backend='triton'.*not supported.*no automatic"):
        _call(inputs, backend="triton")
    with pytest.raises(NotImplementedError):
        get_backend("triton").forward(
            *(inputs[n] for n in NAMES), scale=1.0, initial_state=None, use_qk_l2norm=True,
            chunk_size=64,
        )


def test_eager_is_the_explicit_default(inputs):
    o_default, _ = _call(inputs)
    o_eager, _ = _call(inputs, backend="eager")
    o_ref, _ = recurrent_gated_delta_rule(*(inputs[n].double() for n in NAMES))
    assert torch.equal(o_default, o_eager)
    assert rel_l2(o_eager, o_ref) <= 1e-5


BAD_CASES = [
    ("q 3-D", lambda x: {"q": x["q"][0], "k": x["k"][0]}, ValueError, r"q must be \[B, T, H, K\]"),
    ("k shape", lambda x: {"k": x["k"][:, :, :1]}, ValueError, r"k must have q's shape"),
    ("v 3-D", lambda x: {"v": x["v"][0]}, ValueError, r"v must be \[B, T, HV, V\]"),
    ("B mismatch", lambda x: {"v": x["v"][:1]}, ValueError, r"\(B, T\) = \(1, 10\).*\(2, 10\)"),
    ("T mismatch", lambda x: {"v": x["v"][:, :9]}, ValueError, r"\(B, T\) = \(2, 9\)"),
    ("HV % H", lambda x: {"v": x["v"][:, :, :3], "g": x["g"][..., :3], "beta": x["beta"][..., :3]},
     ValueError, r"HV % H != 0: v has HV=3 heads, q/k have H=2"),
    ("g shape", lambda x: {"g": x["g"][:, :, :2]}, ValueError, r"g must be \[B, T, HV\] = \[2, 10, 4\]"),
    ("beta shape", lambda x: {"beta": x["beta"][:, :5]}, ValueError, r"beta must be \[B, T, HV\]"),
    ("g bf16", lambda x: {"g": x["g"].bfloat16()}, TypeError, r"g \(log decay\) must be float32"),
    ("g int", lambda x: {"g": x["g"].long()}, TypeError, r"g has dtype torch.int64"),
    ("qkv dtypes", lambda x: {"k": x["k"].double()}, TypeError, r"q, k, v must share one dtype"),
    ("state shape", lambda x: {"initial_state": x["initial_state"][:, :2]}, ValueError,
     r"initial_state must be \[B, HV, K, V\] = \[2, 4, 8, 6\]"),
    ("state bf16", lambda x: {"initial_state": x["initial_state"].bfloat16()}, TypeError,
     r"initial_state must be float32 or float64"),
    ("T=0", lambda x: {n: x[n][:, :0] for n in NAMES}, ValueError, r"T=0 must be >= 1"),
    ("chunk 0", lambda x: {"chunk_size": 0}, ValueError, r"chunk_size=0 must be a positive int"),
    ("chunk float", lambda x: {"chunk_size": 64.0}, ValueError, r"chunk_size=64.0"),
    ("not a tensor", lambda x: {"beta": 0.5}, TypeError, r"beta must be a torch.Tensor"),
]


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("case,override,error,pattern", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_inputs_name_the_value_and_the_rule(inputs, case, override, error, pattern, backend):
    with pytest.raises(error, match=pattern):
        _call(inputs, backend=backend, **override(inputs))


def test_eager_block_chunks_must_be_positive():
    with pytest.raises(ValueError, match="block_chunks=0"):
        EagerBackend(0)


def test_package_import_does_not_import_triton():
    code = (
        "import sys, overlap_runtime.ops.gdn as gdn; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert sorted(gdn.__all__) == sorted(n for n in dir(gdn) "
        "if not n.startswith('_') and n not in {'backend', 'chunk', 'function', 'reference', "
        "'summary', 'options'})"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_triton_refuses_tensors_past_int32_offsets_naming_the_count():
    # stride-0 views: the shapes of a 2^31-element problem without its memory
    from overlap_runtime.ops.gdn.triton.capability import check_triton_inputs

    def view(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(1, dtype=dtype).expand(*shape)

    batch, seq_len, heads, dim = 8, 65536, 32, 128  # 2^31 elements per token tensor
    q = view(batch, seq_len, heads, dim)
    v = view(batch, seq_len, heads, dim)
    g = view(batch, seq_len, heads, dtype=torch.float32)
    beta = view(batch, seq_len, heads)
    with pytest.raises(NotImplementedError, match=r"8\*65536\*32\*128 = 2147483648 elements.*"
                                                  r"int32 offsets"):
        check_triton_inputs(q, q, v, g, beta, None, 64)
    # one batch element fewer fits the rule (on the cpu it may still fail, but not on the size)
    try:
        check_triton_inputs(q[:7], q[:7], v[:7], g[:7], beta[:7], None, 64)
    except NotImplementedError as error:
        assert "int32" not in str(error)
