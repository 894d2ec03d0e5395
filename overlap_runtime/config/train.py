"""``TrainConfig``: the trainer's YAML configuration, validated in one place (pydantic v2).

::

    model:            # overlap_runtime.models.Qwen3_5Config (size, layer mix, mlp: swiglu|moe)
      hidden_size: 32
    data:
      seq_len: 256    # global tokens per sequence (split over cp ranks)
      batch_size: 1   # sequences per data-parallel rank per step
      corpus: null    # one UTF-8 file of byte-level windows; null: the packaged corpus
      files: null     # or: text/JSONL/Parquet files or directories of documents (packed)
      format: null    # text | jsonl | parquet; null: from the extensions
      text_field: text
      tokenizer: null # a local tokenizer.json (Hugging Face tokenizers); null: bytes
      bos_token: <bos>
      eos_token: <eos>
      packing: concat # or reset_at_document_boundaries (pp == 1; cp > 1: ring/ulysses attention)
    optimizer:        # AdamW
      lr: 1.0e-3
    train:
      steps: 20
      seed: 0
      activation_checkpoint: false
      compile: false              # torch.compile norms, GDN conv and gates (layers.compile)
      precision: fp32             # or bf16 (also on the CPU: slow, for numerics studies)
      metrics: null               # path of the metrics JSON (or --metrics)
      launch_ahead: true          # launch the next step before reading this one's numbers
      validate_step_graph: true   # stepgraph.compile_step proven deadlock-free before step 1
      check_conformance: false    # record step 1 and check it against the step graph
      step_graph_max_tasks: 500000 # a larger step graph is an error while validating (below)
      accelerator:                # the layout: world = pp x dp_replicate x dp_shard x cp
        device: cpu
        world_size: 4             # ranks `overlap-runtime train` spawns (torchrun: WORLD_SIZE)
        dp_replicate: 1           # HSDP replicas
        dp_shard: -1              # FSDP2 shard degree; -1: what pp x dp_replicate x cp leave
        cp: 4
        tp: 1
        pp: 1
        ep: 1                     # borrowed from dp_shard x cp (see trainer.parallel_dims)
        ulysses_degree: null
        linear_attention_cp_mode: prefix_scan # ulysses | p2p | all_gather | prefix_scan
        linear_attention_gdn_backend: eager   # eager | triton
        full_attention_cp_mode: ring          # ulysses | ring | all_gather_kv | hierarchical
        hierarchical_cp: null                 # {a2a: 2, ring: 2} for hierarchical (config.cp)
        full_attention_cp_modes: null         # per full_attention layer, e.g. [ring, ulysses]
        linear_attention_cp_modes: null       # per GDN layer, e.g. [p2p, all_gather, p2p]
      pipeline:                   # used when accelerator.pp > 1
        schedule: 1f1b            # gpipe | 1f1b | interleaved_1f1b | zero_bubble | dualpipev
        microbatches: 4           # per step; must divide data.batch_size
        virtual_stages: 1         # model chunks per pipeline rank (dualpipev: 2)
        overlap_b_f: false        # OVERLAP_B_F compound steps (interleaved_1f1b / 1f1b)
        defer_expert_w: false     # zero_bubble/dualpipev with ep > 1: expert W tasks queued,
                                  # run in the EP all-to-all windows (not with overlap_b_f)
        overlap_p2p: true
        layers_per_stage: null    # e.g. [2, 2]; null: an even split (trainer.pipeline_split)
    metrics:                      # streamed every train.log_every steps (trainer.metrics)
      jsonl: null                 # JSONL path, one record per logged step (rank 0)
      tensorboard: null           # TensorBoard log dir (pip install overlap_runtime[tensorboard])
      progress: auto              # auto (bar on a TTY, else lines) | bar | lines | off
    profiling:                    # torch.profiler window (trainer.profiling)
      enable: false
      steps: [2, 3]               # first and last profiled step (1-based, inclusive)
      dir: profiles               # rank<r>.pt.trace.json per rank, exec_trace.json

``world_size = pp x dp_replicate x dp_shard x cp`` (:class:`~overlap_runtime.config.layout.Layout`
owns the rule; the trainer's ``ParallelDims`` every mesh); ``dp = dp_replicate x dp_shard``
data-parallel groups read different rows; FSDP2 shards over ``dp_shard x cp``.

Every rule that a combination breaks fails at load time with the dotted field name and the rule
(:class:`ConfigError`); unknown keys are errors too (a typo must not silently fall back to a
default).
"""

from __future__ import annotations

import codecs
import importlib.util
import stat
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from overlap_runtime.config.cp import HierarchicalCPConfig, cp_mode_problems, modes_of_kind
from overlap_runtime.config.cp_modes import (DEFAULT_ATTENTION_CP_MODE, DEFAULT_GDN_CP_MODE,
                                             cp_mode_names, get_cp_mode)
from overlap_runtime.config.data_sources import (load_tokenizer, resolve_files,
                                                 special_ids)
from overlap_runtime.config.hf import (HFConfigError, architecture_conflicts, config_from_hf,
                                       read_hf_config)
from overlap_runtime.config.layout import Layout
from overlap_runtime.config.model import Qwen3_5Config
from overlap_runtime.config.run import (MAX_TIMEOUT_S, CheckpointConfig, MetricsConfig,
                                        ProfilingConfig, _Strict, check_output_path)
from overlap_runtime.config.yaml_io import DuplicateKeyError, load_yaml
from overlap_runtime.ops.gdn.options import TRITON_CHUNK
from overlap_runtime.schedules import ScheduleSpec
from overlap_runtime.schedules.registry import get_schedule_kind


class ConfigError(ValueError):
    """An invalid training configuration; the message names each offending field."""


class AcceleratorConfig(_Strict):
    """Parallel layout (``train.accelerator``). See the module docstring for the fields."""

    device: Literal["cpu", "cuda", "npu"] = "cpu"
    world_size: int | None = Field(None, ge=1, description="ranks to spawn; None: the product "
                                                           "of the degrees")
    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(-1, ge=-1, description="-1: the rest of the world")
    cp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    ulysses_degree: int | None = None
    # the names are the registered modes (config.cp_modes); the defaults are its choice
    linear_attention_cp_mode: str = DEFAULT_GDN_CP_MODE
    linear_attention_gdn_backend: Literal["eager", "triton"] = "eager"
    full_attention_cp_mode: str = DEFAULT_ATTENTION_CP_MODE
    hierarchical_cp: HierarchicalCPConfig | None = None
    full_attention_cp_modes: list[str] | None = None  # per layer: config.cp
    linear_attention_cp_modes: list[str] | None = None
    comm_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)

    @field_validator("linear_attention_cp_mode", "full_attention_cp_mode")
    @classmethod
    def _registered_mode(cls, mode: str, info: ValidationInfo) -> str:
        kind = info.field_name.removesuffix("_cp_mode")  # type: ignore[union-attr]
        names = cp_mode_names(kind)
        if mode not in names:
            quoted = [repr(n) for n in names]
            raise ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]} (the "
                             f"registered {kind} CP modes; config.cp_modes.register_cp_mode "
                             f"adds one), got {mode!r}")
        return mode

    @property
    def resolved_world_size(self) -> int:
        """Number of ranks: ``world_size`` or, when unset, ``pp x dp_replicate x dp_shard x cp``
        (``dp_shard = -1`` counting as 1)."""
        if self.world_size is not None:
            return self.world_size
        return self.pp * self.dp_replicate * max(self.dp_shard, 1) * self.cp

    def layout(self) -> Layout:
        """The validated layout (raises ValueError naming the fields); the trainer's
        ``ParallelDims.of(layout)`` builds its meshes."""
        return Layout(world_size=self.resolved_world_size, dp_shard=self.dp_shard,
                            cp=self.cp, pp=self.pp, ep=self.ep, dp_replicate=self.dp_replicate,
                            cp_a2a=self.hierarchical_cp.a2a if self.hierarchical_cp else None)


class PipelineConfig(_Strict):
    """Pipeline schedule (``train.pipeline``), used when ``train.accelerator.pp > 1``."""

    schedule: str = "1f1b"  # a registered kind (schedules.registry.get_schedule_kind)
    microbatches: int = Field(4, ge=1, description="microbatches per step (divide batch_size)")
    virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank")
    overlap_b_f: bool = False
    defer_expert_w: bool = False
    overlap_p2p: bool = True
    layers_per_stage: list[int] | None = None

    @field_validator("schedule")
    @classmethod
    def _registered_kind(cls, kind: str) -> str:
        get_schedule_kind(kind)  # ValueError naming the registered kinds
        return kind


class DataConfig(_Strict):
    """Training data (``data``): the packaged byte-level corpus, one text file (``corpus``), or
    real documents (``files``) shuffled per epoch and packed into rows (``trainer.data``,
    ``trainer.documents``, ``trainer.packed_dataset``, ``trainer.batch``; docs/training.md)."""

    corpus: str | None = Field(None, description="path of a UTF-8 text file; None: packaged")
    seq_len: int = Field(256, ge=2, description="global tokens per sequence")
    batch_size: int = Field(1, ge=1, description="sequences per data-parallel rank per step")
    files: list[str] | None = Field(None, description="text/JSONL/Parquet files or directories "
                                                      "of documents; None: corpus")
    format: Literal["text", "jsonl", "parquet"] | None = Field(
        None, description="None: from the files' extensions (.txt, .jsonl/.json, .parquet)")
    text_field: str = Field("text", min_length=1, description="JSONL/Parquet field of the text")
    tokenizer: str | None = Field(None, description="local tokenizer.json; None: byte tokens")
    bos_token: str | None = Field("<bos>", description="token before each document; None: none")
    eos_token: str = Field("<eos>", description="token after each document")
    packing: Literal["concat", "reset_at_document_boundaries"] = "concat"

    @field_validator("corpus")
    @classmethod
    def _corpus_is_text(cls, corpus: str | None) -> str | None:
        if corpus is not None:
            _check_corpus(corpus)
        return corpus

    @model_validator(mode="after")
    def _check_sources(self) -> "DataConfig":
        errors = _data_source_problems(self)
        if errors:
            raise ValueError("\n  ".join(errors))
        return self


def _data_source_problems(data: DataConfig) -> list[str]:
    """Rules of the ``data`` section on its own: one source, files that exist in one known
    format, an optional package that is importable, a loadable tokenizer holding the bos/eos
    tokens."""
    if data.files is None:
        out = [f"data.{name}={value!r} applies to data.files only (data.corpus and the packaged "
               f"corpus are byte-level windows)"
               for name, value in (("format", data.format), ("tokenizer", data.tokenizer))
               if value is not None]
        if (data.bos_token, data.eos_token) != ("<bos>", "<eos>"):
            out.append(f"data.bos_token={data.bos_token!r} / data.eos_token={data.eos_token!r}: "
                       f"only the defaults '<bos>' / '<eos>' apply to data.corpus and the "
                       f"packaged corpus; set data.files to choose them")
        return out
    if data.corpus is not None:
        return [f"data.corpus={data.corpus!r} and data.files are exclusive (one source)"]
    try:
        fmt, _ = resolve_files(data.files, data.format)
    except ValueError as exc:
        return [str(exc)]
    out = []
    if fmt != "text" and importlib.util.find_spec("datasets") is None:
        out.append(f"data.format={fmt!r} is read through Hugging Face datasets, which is not "
                   f"installed: pip install overlap_runtime[data]")
    try:
        special_ids(load_tokenizer(data.tokenizer), data.bos_token, data.eos_token)
    except (ValueError, ImportError) as exc:
        out.append(str(exc))
    return out


def _data_problems(config: "TrainConfig") -> list[str]:
    """Rules of ``data`` against the model and the layout: the tokenizer's vocabulary fits
    ``model.vocab_size``; ``reset_at_document_boundaries`` needs pp == 1 and, for cp > 1, ring
    or ulysses full attention. The GDN takes ``cu_seqlens`` on either backend: for cp == 1 one
    masked conv and one varlen op call per layer (``layers.sequence_mixer.LocalGDNMixer``,
    ``model.gdn_backend`` eager or triton), for cp > 1 every GDN CP mode, the
    default prefix_scan included (``context_parallel/gdn/varlen.py``)."""
    data, acc, m = config.data, config.train.accelerator, config.model
    out: list[str] = []
    vocab = load_tokenizer(data.tokenizer).vocab_size
    if m.vocab_size < vocab:
        what = (f"data.tokenizer={data.tokenizer!r} ({vocab} tokens)" if data.tokenizer else
                f"the byte-level vocabulary of the data ({vocab}: 256 bytes + 4 specials)")
        out.append(f"model.vocab_size={m.vocab_size} is smaller than {what}")
    if data.packing == "reset_at_document_boundaries":
        rule = "data.packing='reset_at_document_boundaries'"
        if acc.pp > 1:
            out.append(f"{rule} is implemented for pp == 1 (the pipeline stages do not carry "
                       f"cu_seqlens); got train.accelerator.pp={acc.pp}")
        if acc.cp > 1:  # every GDN mode and backend; attention only ring / ulysses
            attn = modes_of_kind(acc, "full_attention")
            if attn - {"ring", "ulysses"}:
                out.append(f"{rule} under cp={acc.cp} needs train.accelerator."
                           f"full_attention_cp_mode 'ring' or 'ulysses' (causal within each "
                           f"document) in every attention layer; got {sorted(attn)}")
            t = config.train
            if t.validate_step_graph or t.check_conformance:
                out.append(f"{rule} under cp={acc.cp}: the step graph (stepgraph.layer_program) "
                           f"does not describe the packed CP messages yet (per-document halos, "
                           f"the cu_seqlens agreement); set train.validate_step_graph: false "
                           f"and train.check_conformance: false")
    return out


class OptimizerConfig(_Strict):
    """AdamW (``optimizer``) with linear warmup to a constant ``lr``."""

    name: Literal["adamw"] = "adamw"
    # AdamW moves every weight by about lr per step: above 1 no run converges
    lr: float = Field(1e-3, gt=0, le=1.0, allow_inf_nan=False)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip threshold; None: no clip")
    # AdamW's kernels: for_loop (foreach=False), foreach or fused; baseline and ranks alike
    implementation: Literal["for_loop", "foreach", "fused"] = "fused"

    @field_validator("betas")
    @classmethod
    def _betas_in_0_1(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):  # NaN fails too
            raise ValueError(f"optimizer.betas={betas}: each beta must be in [0, 1) (AdamW's "
                             "moving-average factors)")
        return betas


class TrainSection(_Strict):
    """The ``train`` block: loop length, seed, precision, checkpointing, layout."""

    steps: int = Field(20, ge=1)
    # the data's generators are seeded with seed * 1_000_003 + step, which must fit torch's
    # 64-bit seed for any number of steps a run takes
    seed: int = Field(0, ge=0, lt=2**32)
    activation_checkpoint: bool = False
    compile: bool = False  # torch.compile the elementwise pieces (layers.compile)
    precision: Literal["fp32", "bf16"] = "fp32"
    log_every: int = Field(1, ge=1)
    # launch step n+1's forward and backward before step n's numbers are read (trainer.launch_ahead)
    launch_ahead: bool = True
    validate_step_graph: bool = True  # prove the step's task graph deadlock-free first
    check_conformance: bool = False  # record step 1, check it against the graph (tests)
    step_graph_max_tasks: int = Field(500_000, ge=1)  # larger graphs: validate offline
    metrics: str | None = None
    accelerator: AcceleratorConfig = AcceleratorConfig()
    pipeline: PipelineConfig = PipelineConfig()

    @field_validator("metrics")
    @classmethod
    def _metrics_writable(cls, path: str | None) -> str | None:
        if path is not None:
            check_output_path("train.metrics", path)
        return path


def _profiling_problems(config: "TrainConfig") -> list[str]:
    p = config.profiling
    if p.enable and p.steps[1] > config.train.steps:
        return [f"profiling.steps={list(p.steps)} ends after the run's last step "
                f"(train.steps={config.train.steps})"]
    return []


class TrainConfig(_Strict):
    """The whole configuration (see the module docstring)."""

    model: Qwen3_5Config = Qwen3_5Config()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    profiling: ProfilingConfig = ProfilingConfig()

    @property
    def dp(self) -> int:
        """Data-parallel degree ``dp_replicate x dp_shard`` (who reads different rows)."""
        return self.train.accelerator.layout().dp

    @model_validator(mode="after")
    def _check_layout(self) -> "TrainConfig":
        acc, m = self.train.accelerator, self.model
        has_gdn = "linear_attention" in m.layer_types
        errors: list[str] = []
        errors.extend(Layout.layout_problems(
            world_size=acc.resolved_world_size, dp_shard=acc.dp_shard, cp=acc.cp, pp=acc.pp,
            ep=acc.ep, dp_replicate=acc.dp_replicate, prefix="train.accelerator."))
        errors.extend(_pipeline_problems(self))
        errors.extend(_expert_problems(self))
        errors.extend(_profiling_problems(self))
        if acc.tp > 1:
            if acc.cp > 1 and has_gdn:
                errors.append(f"train.accelerator.tp={acc.tp}: linear-attention (GDN) context "
                              f"parallelism needs tp == 1; got cp={acc.cp}")
            else:
                errors.append(f"train.accelerator.tp={acc.tp}: tensor parallelism is not "
                              f"supported by this trainer yet (use tp: 1)")
        if acc.ulysses_degree is not None and acc.ulysses_degree != acc.cp:
            errors.append(f"train.accelerator.ulysses_degree={acc.ulysses_degree}: only None or "
                          f"cp={acc.cp} (pure Ulysses) is supported; for Ulysses x ring use "
                          f"full_attention_cp_mode: hierarchical with hierarchical_cp")
        errors.extend(_data_problems(self))
        if self.data.seq_len % acc.cp:
            errors.append(f"data.seq_len={self.data.seq_len} is not a multiple of "
                          f"train.accelerator.cp={acc.cp} (contiguous split)")
        errors.extend(_gdn_length_problems(self))
        errors.extend(cp_mode_problems(self))
        if errors:
            raise ValueError("\n  ".join(errors))
        return self

    def with_overrides(self, **train_fields: Any) -> "TrainConfig":
        """A validated copy with some ``train`` fields replaced (e.g. ``steps=5``)."""
        data = self.model_dump()
        data["train"].update(train_fields)
        return TrainConfig.model_validate(data)


def _defer_expert_w_problems(config: "TrainConfig") -> list[str]:
    """``train.pipeline.defer_expert_w``: split schedules (I/W), MoE with ep > 1, no
    overlap_b_f."""
    acc, pl, m = config.train.accelerator, config.train.pipeline, config.model
    if not pl.defer_expert_w:
        return []
    why = []
    if acc.pp == 1 or pl.schedule not in ("zero_bubble", "dualpipev"):
        why.append(f"a split-backward schedule (zero_bubble or dualpipev with pp > 1; got "
                   f"schedule {pl.schedule!r}, pp={acc.pp})")
    if m.mlp != "moe" or acc.ep == 1:
        why.append(f"MoE layers with expert parallelism (got model.mlp={m.mlp!r}, "
                   f"ep={acc.ep})")
    if pl.overlap_b_f:
        why.append("overlap_b_f: false (its two threads would run one W queue at once)")
    if not why:
        return []
    return ["train.pipeline.defer_expert_w=true needs " + "; and ".join(why)]


def _pipeline_problems(config: "TrainConfig") -> list[str]:
    """Rules of ``train.pipeline`` against the layout and the model (empty when pp == 1)."""
    acc, pl, m = config.train.accelerator, config.train.pipeline, config.model
    if acc.pp == 1:
        return _defer_expert_w_problems(config)
    out: list[str] = []
    stages = acc.pp * pl.virtual_stages
    if stages > m.num_hidden_layers:
        out.append(f"train.accelerator.pp={acc.pp} x train.pipeline.virtual_stages="
                   f"{pl.virtual_stages} = {stages} stages exceed model.num_hidden_layers="
                   f"{m.num_hidden_layers} (every stage holds at least one decoder layer)")
    if pl.layers_per_stage is not None:
        lps = pl.layers_per_stage
        if len(lps) != stages or sum(lps) != m.num_hidden_layers or min(lps) < 1:
            out.append(f"train.pipeline.layers_per_stage={lps} must have pp x virtual_stages = "
                       f"{stages} entries, each >= 1, summing to model.num_hidden_layers="
                       f"{m.num_hidden_layers}")
    if config.data.batch_size % pl.microbatches:
        out.append(f"train.pipeline.microbatches={pl.microbatches} must divide data.batch_size="
                   f"{config.data.batch_size} (a microbatch is batch_size / microbatches rows)")
    if m.mlp == "moe" and m.moe_aux_loss_pooling == "model":
        out.append("model.moe_aux_loss_pooling='model' with train.accelerator.pp > 1: the loss "
                   "pools every MoE layer of one forward, a pipeline stage holds only some; use "
                   "'per_layer'")
    if m.tie_word_embeddings:
        out.append("model.tie_word_embeddings=true with train.accelerator.pp > 1: the embedding "
                   "(first stage) and the LM head (last stage) would share one parameter across "
                   "pipeline ranks; untie them")
    if pl.overlap_b_f and acc.cp > 1:
        out.append(f"train.pipeline.overlap_b_f=true with train.accelerator.cp={acc.cp}: the two "
                   f"threads of an OVERLAP_B_F step would issue context-parallel messages on one "
                   f"group in a different order on different ranks (the HookCoordinator orders "
                   f"only the expert all-to-alls); use cp: 1 or overlap_b_f: false")
    out.extend(_defer_expert_w_problems(config))
    try:
        schedule_spec(config)
    except ValidationError as exc:
        for err in exc.errors():
            out.append(f"train.pipeline (schedule {pl.schedule!r}, pp={acc.pp}): "
                       f"{err['msg'].removeprefix('Value error, ')}")
    return out


_CORPUS_PREFIX = 1 << 20  # bytes of data.corpus checked for UTF-8 at load


def _check_corpus(corpus: str) -> None:
    """``data.corpus`` names a readable, non-empty regular file of UTF-8 text (its first MiB is
    decoded; a whitespace-only file counts as empty, as in ``trainer.data.load_corpus``)."""
    p = Path(corpus)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"data.corpus={corpus!r}: no such file") from None
    except OSError as exc:
        raise ValueError(f"data.corpus={corpus!r}: cannot stat it: {exc}") from None
    if not stat.S_ISREG(mode):
        what = ("a directory" if stat.S_ISDIR(mode) else "a character device"
                if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ValueError(f"data.corpus={corpus!r} is not a regular file ({what}); it must name "
                         "a UTF-8 text file")
    try:
        with p.open("rb") as f:
            head = f.read(_CORPUS_PREFIX)
            whole = not f.read(1)
    except OSError as exc:
        raise ValueError(f"data.corpus={corpus!r}: cannot read it: {exc}") from None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as exc:
        raise ValueError(f"data.corpus={corpus!r} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    if whole and not text.strip():
        raise ValueError(f"data.corpus={corpus!r}: the file is empty"
                         + (" (only whitespace)" if head else ""))


def _gdn_length_problems(config: "TrainConfig") -> list[str]:
    """Rules on each CP rank's share of a sequence that the GDN context-parallel mixers check
    before any communication (``context_parallel.gdn.common``: ``check_halo``,
    ``check_backend_before_comm``), checked here at load instead of after the ranks start.
    With cp == 1 no CP mixer is installed and neither applies."""
    acc, m = config.train.accelerator, config.model
    if acc.cp == 1 or "linear_attention" not in m.layer_types or config.data.seq_len % acc.cp:
        return []  # (a seq_len that cp does not divide has its own error)
    local = config.data.seq_len // acc.cp
    per_rank = (f"data.seq_len={config.data.seq_len} / train.accelerator.cp={acc.cp} = {local} "
                f"tokens per CP rank")
    out: list[str] = []
    halo = m.linear_conv_kernel_dim - 1
    gdn_names = cp_mode_names("linear_attention")  # an unknown name has its own error
    halo_modes = sorted(mode for mode in modes_of_kind(acc, "linear_attention")
                        if mode in gdn_names and get_cp_mode("linear_attention", mode).halo)
    if halo_modes and local < halo:
        # a head-split mode gathers the whole sequence before the conv; the others pass a halo
        out.append(f"{per_rank} is shorter than the GDN conv halo model.linear_conv_kernel_dim "
                   f"- 1 = {halo} (train.accelerator.linear_attention_cp_mode "
                   f"{', '.join(map(repr, halo_modes))}): each rank must hold at least the halo")
    if acc.linear_attention_gdn_backend == "triton" and local % TRITON_CHUNK:
        out.append(f"{per_rank} is not a multiple of the chunk size {TRITON_CHUNK} "
                   f"(train.accelerator.linear_attention_gdn_backend='triton'): pad data.seq_len "
                   f"to a multiple of {TRITON_CHUNK} * cp = {TRITON_CHUNK * acc.cp}")
    return out


def schedule_spec(config: "TrainConfig") -> Any:
    """The ``ScheduleSpec`` of ``train.pipeline`` (placement: the kind's own, ``v`` for
    dualpipev); raises ``pydantic.ValidationError`` naming the broken rule."""
    acc, pl = config.train.accelerator, config.train.pipeline
    return ScheduleSpec(kind=pl.schedule, pp_size=acc.pp, num_microbatches=pl.microbatches,
                        virtual_stages=pl.virtual_stages, overlap_b_f=pl.overlap_b_f,
                        overlap_p2p=pl.overlap_p2p,
                        placement=get_schedule_kind(pl.schedule).placements[0])


def _expert_problems(config: "TrainConfig") -> list[str]:
    """Rules of expert parallelism against the model."""
    acc, m = config.train.accelerator, config.model
    out: list[str] = []
    if acc.ep > 1 and m.mlp != "moe":
        out.append(f"train.accelerator.ep={acc.ep} needs model.mlp='moe' (got {m.mlp!r})")
    if acc.ep > 1 and m.num_experts % acc.ep:
        out.append(f"train.accelerator.ep={acc.ep} must divide model.num_experts="
                   f"{m.num_experts} (each EP rank holds num_experts / ep experts)")
    return out


def _format(exc: ValidationError, source: str) -> str:
    lines = [f"invalid training configuration {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)


def _import_model_section(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` with the model section's architecture read from ``model.init_from``'s
    ``config.json`` (the Hugging Face import): YAML may repeat an architecture field only with
    the imported value; backends, chunk size, kernel options and the aux-loss weight stay the
    YAML's."""
    model = data.get("model")
    if not isinstance(model, dict) or not model.get("init_from"):
        return data
    init_from = model["init_from"]
    if not isinstance(init_from, str):
        raise ConfigError(f"{source}: model.init_from={init_from!r} must be a directory path")
    try:
        imported = config_from_hf(read_hf_config(init_from), f"{init_from}/config.json")
    except HFConfigError as exc:
        raise ConfigError(f"{source}: model.init_from: {exc}") from None
    conflicts = architecture_conflicts(imported, model)
    if conflicts:
        raise ConfigError(f"{source}: " + "\n  ".join(conflicts))
    merged = {**imported, **{k: v for k, v in model.items() if k != "moe_aux_loss_coef"
                             or v is not None}}
    return {**data, "model": merged}


def config_from_dict(data: dict[str, Any], source: str = "(dict)") -> TrainConfig:
    """Validate a parsed configuration; raise :class:`ConfigError` naming the fields.

    ``model.init_from`` (a Hugging Face model directory) fills the model's architecture from
    its ``config.json`` first (``config.hf``)."""
    data = _import_model_section(data, source)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc, source)) from None


def _override_value(text: str) -> Any:
    """A ``--set`` value: YAML scalar / list syntax (``3``, ``true``, ``null``, ``[2, 2]``), with
    unquoted ``1e-4``-style floats (plain YAML reads them as strings) taken as floats; a quoted
    value (``'"2024"'``) stays the string it quotes."""
    value = _load_yaml(text, "--set value") if text.strip() else ""
    if isinstance(value, str) and text.strip()[:1] not in ("'", '"'):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(config: TrainConfig, assignments: list[str],
                    source: str = "(overrides)") -> TrainConfig:
    """``config`` with ``dotted.field=value`` assignments applied and validated as a whole.

    Example: ``["optimizer.lr=1e-4", "train.accelerator.cp=4"]``. Every assignment must name an
    existing section path (``train.accelerator``); the last part is validated by the same
    pydantic model as the YAML, so an unknown field or a value that breaks a rule raises
    :class:`ConfigError` naming the dotted field.
    """
    # only what was given (the rest re-defaults), so that e.g. model.init_from sees the
    # architecture fields the user wrote, not every default; the full dump says which
    # sections exist
    data = config.model_dump(mode="json", exclude_unset=True)
    schema = config.model_dump(mode="json")
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected DOTTED.FIELD=VALUE, e.g. optimizer.lr=1e-4")
        parts = key.split(".")
        node: Any = data
        full: Any = schema
        for i, part in enumerate(parts[:-1]):
            child = full.get(part) if isinstance(full, dict) else None
            if not isinstance(child, dict):
                where = ".".join(parts[:i + 1])
                known = sorted(k for k, v in full.items() if isinstance(v, dict)) \
                    if isinstance(full, dict) else []
                raise ConfigError(f"--set {key}: {where} is not a section of the configuration "
                                  f"(sections here: {', '.join(known) or 'none'})")
            full = child
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _override_value(raw)
    return config_from_dict(data, source)


def _load_yaml(text: str, source: str) -> Any:
    """``text`` parsed as YAML (safe types, duplicate keys refused); errors name ``source``."""
    try:
        return load_yaml(text, source)
    except DuplicateKeyError as exc:
        raise ConfigError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None


def load_config(path: str | Path) -> TrainConfig:
    """Read and validate a YAML configuration file (see the module docstring).

    Raises:
        ConfigError: a missing file, bad YAML, or a field that breaks a rule (named).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read training configuration {p}: {exc}") from None
    data = _load_yaml(text, str(p)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping (model, data, optimizer, train)")
    return config_from_dict(data, str(p))

