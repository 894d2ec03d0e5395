"""PipelineSchedule: run a compiled schedule over torch.distributed.

``PipelineSchedule(spec, stages, loss_fn).step(*inputs, target=..., losses=[])`` splits the batch
into microbatches, executes this rank's lowered program (the compiled, validated schedule of
:func:`compile_spec`) and returns the merged output on the rank holding the last stage.

Point-to-point, two modes (``spec.overlap_p2p``):

* off: each SEND/RECV runs at its place in the program and is waited there (blocking semantics,
  which the lowering proves deadlock-free);
* on (the default everywhere): receives are posted as early as the program allows and waited
  just before their consumer;
  sends are waited at the end of the step (their buffers are never reused within a step). "As
  early as allowed" keeps each peer's operations in program order (NCCL matches point-to-point
  by order per peer; posting a receive ahead of an earlier send to the same peer can deadlock):
  for every peer we post its receives up to, not past, its next send that has not been issued.

Every wait is bounded by ``timeout_s``; a stall raises :class:`PipelineTimeout` naming the rank,
step index, action and peer, with the rank x step grid; a wait that fails early (the peer died)
raises :class:`PipelinePeerFailed`; anything else raised inside an action leaves ``step`` as a
:class:`PipelineActionError` naming the action (see :mod:`.errors`).

Custom functions: ``register_custom_function(kind, fn)`` for F, B, I, W, OVERLAP_B_F and
OVERLAP_F_B; ``fn(action, ctx)`` with ``ctx`` an :class:`ActionContext`. Without one, a compound
step runs its sub-actions in order. The executor below drives the step through the same public
``ActionContext`` methods a callback uses (``peer``, ``post_recv``, ``wait_recv``, ``send``,
``run``, ``wait_sends``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from overlap_runtime.graph.grid import format_grid
from overlap_runtime.ops import comm
from overlap_runtime.ops.comm import DEFAULT_TIMEOUT_S, CommFailedError, CommTimeoutError
from overlap_runtime.schedules.compile import CompiledSchedule, compile_spec
from overlap_runtime.schedules.ir import Action, ActionKind
from overlap_runtime.schedules.spec import ScheduleSpec

from .context import META_TAG, ActionContext, ActionFn
from .errors import ActionSite, PipelineError, PipelinePeerFailed, PipelineTimeout
from .exec_trace import ExecutionTrace
from .stage import PipelineStage
from .tensor_meta import (HEADER_LEN, BoundaryMeta, as_boundary_value, boundary_length,
                          boundary_meta_of, boundary_metas, decode_boundary, describe_boundary,
                          encode_boundary)

CUSTOM_FUNCTION_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W,
                                   ActionKind.OVERLAP_B_F, ActionKind.OVERLAP_F_B})
_RECV = (ActionKind.RECV_F, ActionKind.RECV_B)
_SEND = (ActionKind.SEND_F, ActionKind.SEND_B)


def _drop_saved(t: torch.Tensor) -> None:
    """Pack hook of the metadata forward: save nothing (its graph never runs backward)."""
    return None


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("the metadata forward's graph is never backpropagated")


class PipelineSchedule:
    """Execute ``spec`` with this rank's ``stages``.

    Args:
        spec: the schedule: a ``ScheduleSpec`` (validated, compiled and checked deadlock-free
            here), or a ``CompiledSchedule`` from ``compile_spec`` or ``compile_table`` (a table
            such as a torch CSV: ``compile_table(load_torch_csv(path))``).
        stages: the :class:`PipelineStage` objects of this rank, those the spec's placement puts
            here (any order).
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        group: the pipeline process group (None: the default group); ranks are group ranks.
        timeout_s: bound of every wait.
        scale_grads: divide each microbatch loss by the number of microbatches in the backward,
            so the gradients equal those of the mean loss over the whole batch.
    """

    def __init__(self, spec: "ScheduleSpec | CompiledSchedule", stages: Sequence[PipelineStage],
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 group: dist.ProcessGroup | None = None, timeout_s: float | None = None,
                 scale_grads: bool = True) -> None:
        compiled = spec if isinstance(spec, CompiledSchedule) else None
        if compiled is not None:
            spec = compiled.spec  # a TableSpec for a table (compile_table), else the spec
        self.spec = spec
        self.group = group
        self.loss_fn = loss_fn
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self.loss_scale = 1.0 / spec.num_microbatches if scale_grads else 1.0
        self.custom_functions: dict[ActionKind, ActionFn] = {}
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        world = dist.get_world_size(group)
        # Every rank must run the same schedule: a rank with another number of microbatches (or
        # another spec) posts sends and receives its peers never match, with activations of other
        # sizes (gloo aborts the process with SIGABRT). One all-gather of 4 int64 on the pipeline
        # group, here, before any check that reads the spec, so every rank raises the same error.
        comm.check_ranks_agree(
            "PipelineSchedule",
            [("the number of microbatches", spec.num_microbatches),
             ("the schedule kind", spec.kind),
             ("the number of stages", spec.num_stages),
             ("the schedule spec", spec)],
            group, device=next((st.device for st in stages), torch.device("cpu")),
            group_name="pp", timeout_s=self.timeout_s)
        if world != spec.pp_size:
            raise ValueError(f"the pipeline group has {world} ranks but spec.pp_size is {spec.pp_size}")
        expected = [s for s in range(spec.num_stages) if spec.stage_to_rank(s) == self.rank]
        given = sorted(st.stage_index for st in stages)
        if given != expected:
            raise ValueError(f"rank {self.rank}: got stages {given} but spec ({spec.kind}, pp "
                             f"{spec.pp_size}, virtual {spec.virtual_stages}, placement "
                             f"{spec.placement}) puts stages {expected} on this rank")
        for st in stages:
            if st.num_stages != spec.num_stages:
                raise ValueError(f"stage {st.stage_index} was built with num_stages={st.num_stages} "
                                 f"but the spec has {spec.num_stages} stages")
        self.stages = {st.stage_index: st for st in stages}
        self.compiled = compiled if compiled is not None else compile_spec(spec)
        self.program: list[Action] = [a for a in self.compiled.lowered[self.rank] if a is not None]
        self._meta_done = all(self._meta_known(st) for st in stages)

    # ------------------------------------------------------------------ public API
    def register_custom_function(self, kind: ActionKind | str, fn: ActionFn) -> None:
        """Run ``fn(action, ctx)`` instead of the built-in behaviour for actions of ``kind``."""
        k = ActionKind(kind)
        if k not in CUSTOM_FUNCTION_KINDS:
            raise ValueError(f"custom functions are for {sorted(x.value for x in CUSTOM_FUNCTION_KINDS)}, "
                             f"not {k.value}")
        if not callable(fn):
            raise TypeError(f"register_custom_function({k.value}): {fn!r} is not callable")
        self.custom_functions[k] = fn

    def grid(self, mark: tuple[int, int] | None = None) -> str:
        """The lowered rank x step grid, optionally marking ``(rank, step)``."""
        programs = {r: [str(a) for a in acts if a is not None]
                    for r, acts in self.compiled.lowered.items()}
        return format_grid(programs, {mark} if mark else set())

    def step(self, *args: torch.Tensor, target: Any = None,
             losses: list[torch.Tensor] | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, trace: ExecutionTrace | None = None,
             **kwargs: Any) -> torch.Tensor | None:
        """One training step over all microbatches: forward, backward, gradients accumulated.

        The signature is torch.distributed.pipelining's ``step`` (plus ``trace``).

        Args:
            args: the whole batch on the rank holding stage 0 (each tensor split on dim 0 into
                ``num_microbatches``); other ranks pass nothing.
            target: the batch's target on the rank holding the last stage (split the same way).
            losses: if given, each microbatch's (unscaled) loss is appended, in microbatch order.
            return_outputs: False: return None (the last stage's outputs are not concatenated).
            loss_kwargs: extra keywords of ``loss_fn(output, target, **loss_kwargs)``.
            trace: if given, filled with this rank's action and wait intervals.
            kwargs: keyword inputs of stage 0's module: tensors are split on dim 0 like
                ``args``, anything else is passed unchanged to every microbatch.

        Returns:
            The outputs of the last stage concatenated over microbatches on its rank (a tuple
            of them, element by element, when the last stage returns a tuple), else None.
        """
        inputs = args
        m = self.spec.num_microbatches
        has_first = 0 in self.stages
        has_last = (self.spec.num_stages - 1) in self.stages
        mb_inputs = _split_inputs(inputs, m, "inputs") if has_first else [() for _ in range(m)]
        mb_kwargs = _split_kwargs(kwargs, m) if has_first and kwargs else []
        if has_last and target is not None:
            mb_targets: list[Any] = _split_target(target, m)
        else:
            mb_targets = [None] * m
        if has_first and not inputs and not kwargs:
            raise ValueError(f"rank {self.rank} holds stage 0 and needs the batch inputs")
        if kwargs and not has_first:
            raise ValueError(f"rank {self.rank}: keyword inputs {sorted(kwargs)} are for the rank "
                             "holding stage 0; this rank does not hold it")
        if not self._meta_done:
            self._exchange_metadata(mb_inputs[0] if has_first else (),
                                    mb_kwargs[0] if mb_kwargs else {})
            self._meta_done = True
        if trace is not None:
            trace.rank = self.rank
        ctx = ActionContext(self, self.rank, self.stages, mb_inputs, mb_targets, {}, trace,
                            kwinputs=mb_kwargs, loss_kwargs=dict(loss_kwargs or {}))
        try:
            self._execute(ctx)
            ctx.step_index, ctx.current_action = len(self.program), None  # the end of the step
            # W tasks still pending (B's whose dW a flush callback deferred) finish the step
            for queue in {id(st.deferred_w): st.deferred_w for st in self.stages.values()
                          if st.deferred_w is not None}.values():
                if queue.pending():
                    with ctx.span("W drain", "compute"):
                        queue.drain(during="end of step", step=len(self.program))
            ctx.wait_sends()
        except BaseException as exc:
            for st in self.stages.values():
                st.clear()
            if isinstance(exc, Exception) and not isinstance(exc, PipelineError):
                # raised by the executor itself (a send, a receive post): named at its action
                raise ctx.action_error(exc) from exc
            raise
        leftover = {s: sorted(st.microbatches) for s, st in self.stages.items() if st.microbatches}
        if leftover:
            raise RuntimeError(f"rank {self.rank}: step ended with microbatches whose backward "
                               f"never ran: {leftover}")
        if losses is not None and has_last:
            losses.extend(ctx.losses[i] for i in sorted(ctx.losses))
        if has_last and return_outputs:
            outs = [ctx.outputs[i] for i in range(m)]
            if isinstance(outs[0], tuple):  # a tuple output: each element concatenated
                return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))  # type: ignore[return-value]
            return torch.cat(outs, dim=0)
        return None

    # ------------------------------------------------------------------ execution
    def _execute(self, ctx: ActionContext) -> None:
        program = self.program
        overlap = self.spec.overlap_p2p
        # per peer: the program positions of its comm ops, for early posting
        per_peer: dict[int, list[int]] = {}
        if overlap:
            for i, a in enumerate(program):
                if a.is_comm:
                    per_peer.setdefault(ctx.peer(a), []).append(i)
        cursor = {p: 0 for p in per_peer}
        posted: set[int] = set()
        for i, action in enumerate(program):
            ctx.step_index = i
            ctx.current_action = action
            if overlap:
                for peer, idxs in per_peer.items():
                    c = cursor[peer]
                    while c < len(idxs):
                        j = idxs[c]
                        a = program[j]
                        if a.kind in _RECV:
                            if j not in posted:
                                ctx.post_recv(a)
                                posted.add(j)
                        elif j >= i:  # a send not issued yet: later receives must wait for it
                            break
                        c += 1
                    cursor[peer] = c
            kind = action.kind
            if kind in _SEND:
                ctx.send(action, wait=not overlap)
            elif kind in _RECV:
                if not overlap:
                    ctx.post_recv(action)
                    ctx.wait_recv(kind, action.stage, action.microbatch)  # type: ignore[arg-type]
            else:
                ctx.run(action)

    # ------------------------------------------------------------------ metadata
    def _meta_known(self, st: PipelineStage) -> bool:
        need_in = not st.is_first and (st.stage_index - 1) not in self.stages
        need_out = not st.is_last and (st.stage_index + 1) not in self.stages
        return (not need_in or st.input_meta is not None) and (not need_out or st.output_meta is not None)

    def _exchange_metadata(self, first_inputs: tuple[torch.Tensor, ...],
                           first_kwargs: dict[str, Any]) -> None:
        """Learn every boundary's tensors (shapes, dtypes, which carry a gradient) once: stage
        by stage, a forward of microbatch 0 with grad enabled (as torch 2.13 does, so each
        output's ``requires_grad`` is known; the graph is dropped at once) and the boundary's
        headers sent to the next rank (bounded waits): the first header, whose tuple length
        says how many follow, then the others in one message."""
        spec = self.spec
        device = next(iter(self.stages.values())).device  # headers travel on the stages' device
        example: tuple[torch.Tensor, ...] | None = None
        for s in range(spec.num_stages):
            here = spec.stage_to_rank(s)
            if s > 0 and spec.stage_to_rank(s - 1) != here and here == self.rank:
                meta = self._recv_boundary(spec.stage_to_rank(s - 1), s, device)
                st = self.stages[s]
                if st.input_meta is not None and st.input_meta != meta:
                    raise ValueError(f"stage {s} was given input_meta "
                                     f"{describe_boundary(st.input_meta)} but stage {s - 1} "
                                     f"produces {describe_boundary(meta)}")
                st.input_meta = meta
                example = _examples(meta, st.device)
            if here != self.rank:
                example = None
                continue
            st = self.stages[s]
            if st.is_last:
                continue
            ins = first_inputs if s == 0 else example
            assert ins is not None
            # grad on (to learn requires_grad), but nothing saved: this graph never runs
            # backward, so its activations are neither kept nor counted by memory meters
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                    _drop_saved, _never_unpacked):
                out = as_boundary_value(st.module(*ins, **(first_kwargs if s == 0 else {})),
                                        f"stage {s} (metadata forward)")
            st.output_meta = boundary_meta_of(out)
            # the next stage here runs on the real values (detached leaves, as in a step)
            example = tuple(t.detach().requires_grad_(bool(m.requires_grad)) for t, m in
                            zip(out if isinstance(out, tuple) else (out,),
                                boundary_metas(st.output_meta)))
            del out
            nxt = spec.stage_to_rank(s + 1)
            if nxt != self.rank:
                headers = encode_boundary(st.output_meta).to(device)
                self._p2p("send", headers[0], nxt, f"metadata of stage {s}")
                if headers.shape[0] > 1:
                    self._p2p("send", headers[1:].reshape(-1), nxt,
                              f"metadata of stage {s} (tensors 1..{headers.shape[0] - 1})",
                              tag=META_TAG - 1)
            else:
                nst = self.stages[s + 1]
                if nst.input_meta is not None and nst.input_meta != st.output_meta:
                    raise ValueError(f"stage {s + 1} was given input_meta "
                                     f"{describe_boundary(nst.input_meta)} but stage {s} "
                                     f"produces {describe_boundary(st.output_meta)}")
                nst.input_meta = st.output_meta

    def _recv_boundary(self, src: int, s: int, device: torch.device) -> BoundaryMeta:
        first = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        self._p2p("recv", first, src, f"metadata for stage {s}")
        first = first.cpu()
        n = boundary_length(first)
        rows = [first.unsqueeze(0)]
        if n > 1:
            rest = torch.zeros((n - 1) * HEADER_LEN, dtype=torch.int64, device=device)
            self._p2p("recv", rest, src, f"metadata for stage {s} (tensors 1..{n - 1})",
                      tag=META_TAG - 1)
            rows.append(rest.cpu().reshape(n - 1, HEADER_LEN))
        return decode_boundary(torch.cat(rows))

    def _p2p(self, op: str, t: torch.Tensor, peer: int, what: str, tag: int = META_TAG) -> None:
        post = comm.isend if op == "send" else comm.irecv
        try:
            # On cuda/npu the wait is device-side; ``header.cpu()`` in the caller then synchronises.
            post(t, peer, self.group, tag=tag, timeout_s=self.timeout_s, what=what).wait()
        except (CommTimeoutError, CommFailedError) as exc:
            site = ActionSite(self.global_rank, self.rank, -1, len(self.program), what, what,
                              None, None, None, threading.current_thread().name)
            gpeer = comm.global_rank(self.group, peer)
            cls = PipelineTimeout if isinstance(exc, CommTimeoutError) else PipelinePeerFailed
            kind = "pipeline timeout" if cls is PipelineTimeout else "pipeline peer failed"
            raise cls(f"{kind} on {site.who()}: {what} ({op} with rank {gpeer}): {exc}", site,
                      gpeer, what) from exc


def _examples(meta: BoundaryMeta, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Zero tensors standing for a boundary in the metadata forward of the next stage, leaves
    requiring grad where the boundary carries a gradient (so that stage's outputs say whether
    they need one)."""
    return tuple(torch.zeros(m.shape, dtype=m.dtype, device=device).requires_grad_(
        bool(m.requires_grad)) for m in boundary_metas(meta))


def _split_inputs(inputs: Sequence[torch.Tensor], m: int, what: str) -> list[tuple[torch.Tensor, ...]]:
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: only tensors can be split into microbatches, got {type(t).__name__}")
        if t.shape[0] < m or t.shape[0] % m:
            raise ValueError(f"{what}: batch dimension {t.shape[0]} cannot be split into {m} equal "
                             f"microbatches")
    chunks = [torch.chunk(t, m, dim=0) for t in inputs]
    return [tuple(c[i] for c in chunks) for i in range(m)]


def _split_kwargs(kwargs: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """Per microbatch: tensors split on dim 0 (as the positional inputs), other values as is."""
    split = {k: _split_inputs([v], m, f"keyword input {k!r}") if isinstance(v, torch.Tensor)
             else None for k, v in kwargs.items()}
    return [{k: (split[k][i][0] if split[k] is not None else v) for k, v in kwargs.items()}
            for i in range(m)]


def _split_target(target: Any, m: int) -> list[Any]:
    if isinstance(target, torch.Tensor):
        return [t[0] for t in _split_inputs([target], m, "target")]
    raise TypeError(f"target must be a tensor split on dim 0, got {type(target).__name__}")


def _microbatches(num_microbatches: int | None, n_microbatches: int | None) -> int:
    """``num_microbatches`` or torch's name for it, ``n_microbatches`` (one of the two)."""
    if num_microbatches is None and n_microbatches is None:
        raise TypeError("give num_microbatches (or torch's name for it, n_microbatches)")
    if num_microbatches is not None and n_microbatches is not None \
            and num_microbatches != n_microbatches:
        raise ValueError(f"num_microbatches={num_microbatches} and n_microbatches="
                         f"{n_microbatches} differ: they are one setting under two names")
    return int(num_microbatches if num_microbatches is not None else n_microbatches)


def _spec(kind: str, stages: Sequence[PipelineStage], num_microbatches: int,
          group: dist.ProcessGroup | None, **flags: Any) -> ScheduleSpec:
    if not stages:
        raise ValueError("no stages given")
    num_stages = stages[0].num_stages
    pp = dist.get_world_size(group)
    virtual = max(1, num_stages // pp)
    if virtual * pp != num_stages:
        raise ValueError(f"{num_stages} stages cannot be placed on {pp} ranks evenly")
    return ScheduleSpec(kind=kind, pp_size=pp, num_microbatches=num_microbatches,
                        virtual_stages=virtual, **flags)


class ScheduleGPipe(PipelineSchedule):
    """GPipe (all forwards, then all backwards), one stage per rank; the spec is built from the
    stages and the pipeline group. ``overlap_p2p`` defaults to True, as in ``ScheduleSpec``."""

    def __init__(self, stages: Sequence[PipelineStage] | PipelineStage,
                 num_microbatches: int | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, overlap_p2p: bool = True,
                 group: dist.ProcessGroup | None = None, timeout_s: float | None = None,
                 scale_grads: bool = True, n_microbatches: int | None = None) -> None:
        num_microbatches = _microbatches(num_microbatches, n_microbatches)
        st = [stages] if isinstance(stages, PipelineStage) else list(stages)
        spec = _spec("gpipe", st, num_microbatches, group, overlap_p2p=overlap_p2p)
        super().__init__(spec, st, loss_fn, group, timeout_s, scale_grads)


class Schedule1F1B(PipelineSchedule):
    """1F1B with one stage per rank (``overlap_b_f``: pair steady-state B and F into
    OVERLAP_B_F steps). ``overlap_p2p`` defaults to True, as in ``ScheduleSpec``."""

    def __init__(self, stages: Sequence[PipelineStage] | PipelineStage,
                 num_microbatches: int | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, overlap_p2p: bool = True,
                 overlap_b_f: bool = False, group: dist.ProcessGroup | None = None,
                 timeout_s: float | None = None, scale_grads: bool = True,
                 n_microbatches: int | None = None) -> None:
        num_microbatches = _microbatches(num_microbatches, n_microbatches)
        st = [stages] if isinstance(stages, PipelineStage) else list(stages)
        spec = _spec("1f1b", st, num_microbatches, group, overlap_p2p=overlap_p2p,
                     overlap_b_f=overlap_b_f)
        super().__init__(spec, st, loss_fn, group, timeout_s, scale_grads)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: several virtual stages (model chunks) per rank, loop placement.
    ``overlap_p2p`` defaults to True, as in ``ScheduleSpec``."""

    def __init__(self, stages: Sequence[PipelineStage], num_microbatches: int | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, overlap_p2p: bool = True,
                 overlap_b_f: bool = False, group: dist.ProcessGroup | None = None,
                 timeout_s: float | None = None, scale_grads: bool = True,
                 n_microbatches: int | None = None) -> None:
        num_microbatches = _microbatches(num_microbatches, n_microbatches)
        st = list(stages)
        spec = _spec("interleaved_1f1b", st, num_microbatches, group, overlap_p2p=overlap_p2p,
                     overlap_b_f=overlap_b_f)
        super().__init__(spec, st, loss_fn, group, timeout_s, scale_grads)
