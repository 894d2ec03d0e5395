"""Shared pieces of GDN context parallelism: the plan, the CP mixers' base, point-to-point
helpers, the checks every rank makes before a message.

:class:`GDNCPPlan` is the immutable configuration one ``LinearAttentionContextParallel.apply``
binds to a layer (mode, backend, process group, timeouts); the sequence mixer ``apply`` installs
on the layer holds it (:class:`ContextParallelGDNMixer`, one subclass per mode, each an
implementation of the strategy protocol of ``overlap_runtime.layers.sequence_mixer``). Nothing per call is stored on the plan, the mixer or
the layer: ranks are read from the group at each call, tensors travel as arguments.

Sequence layout: contiguous. Rank ``r`` of ``P`` holds tokens ``[r*S/P, (r+1)*S/P)`` (the GDN
recurrence and the causal conv run left to right, so rank ``r``'s tokens directly follow rank
``r-1``'s; a zigzag layout is not supported by these modes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlap_runtime.config.cp_modes import get_cp_mode
from overlap_runtime.layers.gated_deltanet import GatedDeltaNet
from overlap_runtime.layers.sequence_mixer import GDNSequenceMixer, MixerInputs, check_layer_inputs
from overlap_runtime.ops import comm
from overlap_runtime.ops.gdn import GDNKernelOptions
from overlap_runtime.ops.gdn import get_backend, validate_inputs
from overlap_runtime.ops.gdn.options import TRITON_CHUNK

@dataclass(frozen=True)
class GDNCPPlan:
    """What ``LinearAttentionContextParallel.apply`` binds to a layer (never per-call data).

    Attributes:
        mode: ``"ulysses"``, ``"p2p"``, ``"all_gather"`` or ``"prefix_scan"``.
        backend: local GDN backend (``"eager"`` or ``"triton"``).
        group: the CP process group (``cp_mesh.get_group()``).
        cp_size: number of ranks in ``group``.
        mesh: the 1-D CP device mesh (to rebuild DTensor outputs).
        timeout_s: bound of every wait (None: ``comm.DEFAULT_TIMEOUT_S``).
        options: the layer's GDN kernel options (``GatedDeltaNet.kernel_options``), checked
            against mode and backend by ``apply`` and passed to every local op call of the
            mode (None: the backend's defaults).
    """

    mode: str
    backend: str
    group: dist.ProcessGroup
    cp_size: int
    mesh: DeviceMesh
    timeout_s: float | None = None
    options: GDNKernelOptions | None = None

    @property
    def rank(self) -> int:
        """This process's rank in the CP group (read from the group on every call)."""
        return dist.get_rank(self.group)


class ContextParallelGDNMixer(GDNSequenceMixer):
    """Base of the CP sequence mixers: the CP boundary and the checks before any communication.

    :meth:`prepare_inputs` takes this rank's contiguous shard ``[B, S/P, hidden]`` (a tensor, or
    a DTensor on the CP mesh placed ``Shard(1)``) and its mask slice ``[B, S/P]``, makes the
    ranks compare their calls (:func:`check_ranks_agree_on_call`, the first collective of every
    forward), checks the shapes and the backend's rules (:func:`check_backend_before_comm`) on
    every rank at the same point, and returns plain local tensors; ``restore`` gives the output the input's form. Each
    mode implements ``forward(layer, proj, mask) -> o [B, S/P, HV, V]``.

    Args:
        plan: the configuration ``LinearAttentionContextParallel.apply`` binds.
    """

    #: With ``backend="triton"``: the fewest scan segments per rank the mode's dense path
    #: runs the op with (its ``StateLink.min_segments``); a smaller ``num_segments`` option
    #: would be overridden, so ``apply`` refuses it.
    triton_min_segments: int = 1

    def __init__(self, plan: GDNCPPlan) -> None:
        super().__init__()
        self.plan = plan

    @property
    def mode(self) -> str:
        """The CP mode (``"ulysses"``, ``"p2p"``, ``"all_gather"`` or ``"prefix_scan"``)."""
        return self.plan.mode

    def extra_repr(self) -> str:
        return f"mode={self.plan.mode!r}, backend={self.plan.backend!r}, cp={self.plan.cp_size}"

    def prepare_inputs(self, layer: GatedDeltaNet, hidden_states: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> MixerInputs:
        local, was_dtensor = _to_local(hidden_states, self.plan, "hidden_states")
        mask = None
        if attention_mask is not None:
            mask, _ = _to_local(attention_mask, self.plan, "attention_mask")
        check_ranks_agree_on_call(layer, local, mask, self.plan)
        check_layer_inputs(layer, local, mask, seq="S/P", where=" (this rank's slice)")
        check_backend_before_comm(layer, local, self.plan)
        return MixerInputs(local, mask, self._as_dtensor if was_dtensor else _same_form)

    def _as_dtensor(self, out: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(out, self.plan.mesh, [Shard(1)], run_check=False)


def _same_form(out: torch.Tensor) -> torch.Tensor:
    return out


def _to_local(x: torch.Tensor, plan: GDNCPPlan, name: str) -> tuple[torch.Tensor, bool]:
    """A DTensor on the CP mesh placed ``Shard(1)`` -> its local shard; tensors pass through."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(x, DTensor):
        return x, False
    placements = tuple(x.placements)
    if placements != (Shard(1),):
        raise ValueError(
            f"{name} is a DTensor placed {placements}; GDN context parallelism needs the "
            "sequence dim sharded, placements (Shard(1),)"
        )
    if x.device_mesh != plan.mesh:
        raise ValueError(f"{name} lives on mesh {x.device_mesh}, not the CP mesh {plan.mesh}")
    return x.to_local(), True


def post_recv(buf: torch.Tensor, src: int, plan: GDNCPPlan, what: str) -> comm.AsyncHandle:
    """Post ``irecv(buf)`` from CP rank ``src``; the returned handle waits with a bound.

    P2P ordering (the invariant that keeps the chain hang-free, also under activation-checkpoint
    recompute): between two neighbours every message of one direction is posted in the same
    program order on both sides - forward ``halo`` then ``H`` (rank r -> r+1), backward ``dH``
    then ``halo grad`` (r+1 -> r) - so untagged gloo/NCCL/HCCL matching pairs them correctly.
    """
    return comm.irecv(buf, src, plan.group, timeout_s=plan.timeout_s, what=what)


def post_send(x: torch.Tensor, dst: int, plan: GDNCPPlan, what: str) -> comm.AsyncHandle:
    """Post ``isend(x)`` to CP rank ``dst``; the handle keeps the sent payload alive until waited."""
    return comm.isend(x, dst, plan.group, timeout_s=plan.timeout_s, what=what)


def check_ranks_agree_on_call(layer: GatedDeltaNet, hidden: torch.Tensor,
                              mask: torch.Tensor | None, plan: GDNCPPlan) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks of the CP group call the
    layer alike: batch size, local sequence length, hidden size, dtype, ``attention_mask``
    (None or its shape), then mode, backend and the layer's heads, head dims and conv kernel.

    Without it a rank with another shard length (Ulysses), batch or dtype (every mode: the halo,
    the state and the summaries have the batch in their shape) posts a message of another size
    and gloo aborts the process. One all-gather of 9 int64 on the CP group per forward
    (``comm.check_ranks_agree``); it runs before every other collective of the forward and
    before the local checks, which then see equal inputs on every rank.
    """
    if plan.cp_size == 1:
        return

    def dim(i: int) -> int | None:
        return int(hidden.shape[i]) if hidden.dim() > i else None

    fields = [
        ("the batch size", dim(0)),
        ("the local sequence length", dim(1)),
        ("the hidden size", dim(2)),
        ("the dtype", hidden.dtype),
        ("attention_mask", None if mask is None else tuple(mask.shape)),
        ("the hidden_states shape", tuple(hidden.shape)),
        ("mode and backend", (plan.mode, plan.backend)),
        ("the layer's heads (key, value) and head dims (K, V)",
         (layer.num_key_heads, layer.num_value_heads, layer.head_k_dim, layer.head_v_dim)),
        ("the conv halo", layer.conv_halo),
    ]
    comm.check_ranks_agree(f"GatedDeltaNet context parallelism (mode={plan.mode!r})", fields,
                           plan.group, device=hidden.device, group_name="cp",
                           timeout_s=plan.timeout_s)


def check_halo(layer: GatedDeltaNet, local_len: int, plan: GDNCPPlan) -> None:
    """Every rank's shard must hold the conv halo: ``local_len >= (kernel - 1) * dilation``."""
    halo = layer.conv_halo
    if local_len < halo:
        raise ValueError(
            f"local sequence {local_len} is shorter than the conv halo {halo} "
            f"((kernel {layer.conv_kernel_size} - 1) * dilation {layer.conv1d.dilation[0]}; "
            f"mode={plan.mode!r}, cp={plan.cp_size}): each rank must hold at least the halo"
        )


def check_backend_before_comm(layer: GatedDeltaNet, hidden: torch.Tensor, plan: GDNCPPlan) -> None:
    """The local GDN backend's rules, checked before any communication (same shapes on every
    rank, so every rank raises at the same point and no peer is left waiting).

    ``backend="triton"``: the local sequence must be whole 64-token chunks (the chunk grid of
    every rank then lines up with the unsplit sequence's, and the state handed across ranks sits
    on a chunk boundary), then the Triton capability rules (device, dtypes, head dims, chunk
    size; ``triton/capability.py``) on tensors of the layer's shapes. ``backend="eager"``: no
    extra rule. Raises ``NotImplementedError`` naming the value and the rule.

    Args:
        hidden: ``[B, T_local, hidden]`` this rank's shard (its dtype and device are the GDN
            inputs').
    """
    if plan.backend != "triton":
        return
    local_len = hidden.shape[1]
    if local_len % TRITON_CHUNK:
        raise NotImplementedError(
            f"local sequence {local_len} is not a multiple of chunk size {TRITON_CHUNK} "
            f"(backend='triton', mode={plan.mode!r}): pad the global sequence to a multiple of "
            f"{TRITON_CHUNK} * cp = "
            f"{TRITON_CHUNK * plan.cp_size}"
        )
    from overlap_runtime.ops.gdn.triton.capability import check_triton_inputs  # no triton import

    dtype, device = hidden.dtype, hidden.device
    gate_dtype = torch.promote_types(dtype, torch.float32)
    qk = torch.empty(1, 1, 1, layer.head_k_dim, dtype=dtype, device=device)
    v = torch.empty(1, 1, 1, layer.head_v_dim, dtype=dtype, device=device)
    gb = torch.empty(1, 1, 1, dtype=gate_dtype, device=device)
    beta = torch.empty(1, 1, 1, dtype=dtype, device=device)
    state = None
    if get_cp_mode("linear_attention", plan.mode).passes_state:  # H_in reaches the op as fp32
        state = torch.empty(1, 1, layer.head_k_dim, layer.head_v_dim, dtype=gate_dtype,
                            device=device)
    check_triton_inputs(qk, qk, v, gb, beta, state, layer.chunk_size)


def check_state_passing_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              g: torch.Tensor, beta: torch.Tensor, plan: GDNCPPlan,
                              chunk_size: int, mode: str) -> None:
    """The checks of a mode that hands GDN states between ranks (p2p chain, prefix scan),
    before any state message and on every rank alike (same shapes), so a refusal raises
    everywhere instead of leaving a peer waiting: the inputs, the backend's rules for an fp32
    incoming state (``H_in``'s dtype and layout), and a backend the mode knows (eager, triton).
    Raises, never falls back."""
    validate_inputs(q, k, v, g, beta, None, chunk_size)
    state = q.new_empty((1, 1, q.shape[-1], v.shape[-1]),
                        dtype=torch.promote_types(q.dtype, torch.float32))
    get_backend(plan.backend).check(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
    if plan.backend not in ("eager", "triton"):  # pragma: no cover - the registry holds these
        raise NotImplementedError(
            f"mode={mode!r} with backend={plan.backend!r}: it knows the 'eager' and 'triton' "
            "local kernels only")
