#!/usr/bin/env bash
# Issue #26: every 2-GPU measurement, in three parts of under 9 minutes each (one device call
# each, `nvidia-h200-x2`), every figure printed as a one-line summary next to its command as soon
# as its run ends (a killed part still leaves what finished).
#
#   benchmarks/gpu_pair.sh [--dry-run] part1|part2|part3
#
#   part1  run 1: the MoE model (configs/gpu_pp2_ep2_moe.yaml) under pp2 x {interleaved_1f1b +
#          overlap_b_f, interleaved_1f1b, zero_bubble, dualpipev} and under ep2; the OVERLAP_B_F
#          pairing with the EP2 all-to-all (benchmarks/moe_overlap.py, same MoE geometry);
#          run 2: `overlap-runtime simulate` of each trainer layout next to its measured step
#   part2  run 3: bf16 alignment, CP2 p2p and Ulysses against one GPU and the one-GPU floor,
#          100 steps (configs/gpu_cp2_bf16_numerics.yaml); run 5: save under cp2, resume
#          under cp1, same loss (configs/gpu_cp2_16k.yaml)
#   part3  run 4: GDN layer CP2 at local 16K-64K with the one-GPU local-length baseline;
#          ring / Ulysses attention at 32K / 64K against one GPU; the whole-model step p2p vs
#          Ulysses (and prefix_scan); a packed (THD) batch under CP2
# (Run 4 comes last because it is the longest part; runs 3 and 5 are short and fit together.)
#
# On the device (the wheels from ../shared/gpu/fetch-wheels.sh carried as .whl):
#   run(kind=nvidia-h200-x2, carry=[".whl"], timeout_s=600, command=
#     "GPU_PAIR_RESULTS=/tmp/pair GPU_PAIR_BUNDLE=$OUT/part1.tgz bash benchmarks/gpu_pair.sh part1 2>&1 | tee $OUT/part1.log")
# Results: every run's log / JSON / JSONL under $GPU_PAIR_RESULTS/<item>/ (default $OUT, else
# out/gpu_pair), its command in <item>/commands.txt and every summary line in summary.txt; with
# GPU_PAIR_BUNDLE set, that folder is re-packed into that tarball after every run (the device
# brings back at most 8 files from $OUT).
#
# --print: run nothing; print each run's argv (NUL-separated, one run a line) for
# tests/test_gpu_pair.py, which parses every command the GPU would run.
# --dry-run (or GPU_PAIR_DRY_RUN=1): the same sequence with tiny sizes on 2 gloo CPU ranks
# (spawned by the trainer and the benchmarks themselves instead of torchrun), to test the
# plumbing here; timeouts stay the GPU ones. tests/test_gpu_pair.py runs it.
set -u -o pipefail

DRY=${GPU_PAIR_DRY_RUN:-0}
PRINT=0
PART=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --print) PRINT=1 ;;
    part1|part2|part3) PART=$arg ;;
    *) echo "error: unknown argument '$arg' (usage: gpu_pair.sh [--dry-run] [--print] part1|part2|part3)" >&2
       exit 2 ;;
  esac
done
[ -n "$PART" ] || { echo "error: name a part: part1, part2 or part3" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
RES=${GPU_PAIR_RESULTS:-${OUT:-$ROOT/out/gpu_pair}}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ "$DRY" = 0 ] && [ "$PRINT" = 0 ]; then
  # /work/shared/gpu/README.md: the wheels (pydantic and companions) before anything else
  if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target .site .whl/*.whl || { echo "error: installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH=$PWD/.site:$PWD
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -c "import pydantic" 2>/dev/null || { echo "error: pydantic is missing: run \
../shared/gpu/fetch-wheels.sh here and carry .whl" >&2; exit 1; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  N=$($PY -c "import torch; print(torch.cuda.device_count())")
  [ "$N" -ge 2 ] || { echo "error: $N CUDA device(s); gpu_pair.sh needs 2 (nvidia-h200-x2)" >&2; exit 1; }
fi
if [ "$DRY" = 0 ]; then
  export PYTHONPATH=${PYTHONPATH:-$PWD}
  TR2=(torchrun --standalone --nproc-per-node 2)
  TR1=(torchrun --standalone --nproc-per-node 1)
  TRAIN2=("${TR2[@]}" -m overlap_runtime.cli train)
  TRAIN1=("${TR1[@]}" -m overlap_runtime.cli train)
  BENCH2=("${TR2[@]}")
  DEV=()          # the configs' own device (cuda) and sizes
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$DRY" = 1 ]; then
  TRAIN2=($PY -m overlap_runtime.cli train)      # spawns train.accelerator.world_size ranks
  TRAIN1=($PY -m overlap_runtime.cli train --world-size 1)
  BENCH2=($PY)                                   # the benchmarks spawn their own gloo ranks
  DEV=(--set train.accelerator.device=cpu --set train.precision=fp32
       --set model.gdn_backend=eager --set train.accelerator.linear_attention_gdn_backend=eager
       --set model.attention_backend=math)
fi
SUMMARY=(env PYTHONPATH="$PYTHONPATH" $PY -m benchmarks.gpu_pair_summary)
SIM=($PY -m overlap_runtime.cli simulate)

# Tiny model for --dry-run (4 layers: 3 GDN + 1 attention, hidden 32); appended to every
# trainer command's overrides after the run's own, so the layout overrides stay the real ones.
tiny_model() {
  [ "$DRY" = 1 ] || return 0
  printf -- '--set\0%s\0' model.hidden_size=32 model.num_hidden_layers=4 \
    model.num_attention_heads=4 model.num_key_value_heads=2 model.head_dim=8 \
    model.linear_num_key_heads=2 model.linear_num_value_heads=4 model.linear_key_head_dim=8 \
    model.linear_value_head_dim=8 "$@"
}
read_tiny() { mapfile -d '' TINY < <(tiny_model "$@"); }

say() { [ "$PRINT" = 1 ] && return 0; echo "$*" | tee -a "$RES/summary.txt"; }
bundle() {
  [ -n "${GPU_PAIR_BUNDLE:-}" ] || return 0
  tar czf "$GPU_PAIR_BUNDLE.tmp" -C "$RES" . 2>/dev/null && mv "$GPU_PAIR_BUNDLE.tmp" "$GPU_PAIR_BUNDLE"
}
# run ITEM NAME TIMEOUT_S COMMAND...: the command echoed, its output in ITEM/NAME.log, then
# one status line (ok or the exit code; 124 = its timeout).
run() {
  local item=$1 name=$2 limit=$3; shift 3
  mkdir -p "$RES/$item"
  local t0=$SECONDS rc
  if [ "$PRINT" = 1 ]; then printf '%s\0' "$@"; printf '\n'; return 0; fi
  say "\$ $*"
  echo "$*" >> "$RES/$item/commands.txt"
  timeout -k 15 "$limit" "$@" > "$RES/$item/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then say "[$item/$name] ok in $((SECONDS - t0)) s"
  else
    say "[$item/$name] FAILED rc=$rc after $((SECONDS - t0)) s (limit $limit s); last lines:"
    tail -n 5 "$RES/$item/$name.log" | sed 's/^/    /' | tee -a "$RES/summary.txt"
  fi
  bundle
  return $rc
}
show() {  # show FILE LINES [PATTERN]: a benchmark's own table, into the summary
  [ "$PRINT" = 1 ] && return 0
  grep -iE "${3:-.}" "$1" | tail -n "$2" | tee -a "$RES/summary.txt"; bundle
}
summary() { [ "$PRINT" = 1 ] && return 0; "${SUMMARY[@]}" "$@" | tee -a "$RES/summary.txt"; bundle; }

say "== gpu_pair.sh $PART (dry run: $DRY) $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# ---------------------------------------------------------------------------------------------
part1() {
  local cfg=configs/gpu_pp2_ep2_moe.yaml d=run1_moe steps=10
  declare -A LAYOUT=(
    [pp2_ib_overlap]=""
    [pp2_ib_plain]="--set train.pipeline.overlap_b_f=false"
    [pp2_zero_bubble]="--set train.pipeline.schedule=zero_bubble --set train.pipeline.virtual_stages=1 --set train.pipeline.overlap_b_f=false"
    [pp2_dualpipev]="--set train.pipeline.schedule=dualpipev --set train.pipeline.overlap_b_f=false"
    [ep2]="--set train.accelerator.pp=1 --set train.accelerator.ep=2 --set train.pipeline.overlap_b_f=false"
  )
  local dry_data=()
  [ "$DRY" = 1 ] && { dry_data=(--set data.seq_len=64 --set model.num_experts=4 --set model.num_experts_per_tok=2
    --set model.moe_intermediate_size=16 --set model.shared_expert_intermediate_size=16); steps=3; }
  read_tiny
  local name
  for name in pp2_ib_overlap pp2_ib_plain pp2_zero_bubble pp2_dualpipev ep2; do
    # shellcheck disable=SC2206
    local sets=(${LAYOUT[$name]})
    run "$d" "$name" 110 "${TRAIN2[@]}" "$cfg" "${sets[@]}" "${DEV[@]}" "${dry_data[@]}" "${TINY[@]}" \
      --steps "$steps" --quiet --metrics "$RES/$d/$name.json" --set "metrics.jsonl=$RES/$d/$name.jsonl" \
      && summary train "$name" "$RES/$d/$name.json" "$RES/$d/$name.jsonl"
  done
  summary ratio "pp2 interleaved_1f1b with / without overlap_b_f (goal <= 0.8x with the EP all-to-all)" \
    "$RES/$d/pp2_ib_overlap.json" "$RES/$d/pp2_ib_plain.json"

  # The OVERLAP_B_F pairing with the EP2 all-to-all: the MoE geometry of the config, one 4096-token
  # microbatch per rank, 2 MoE blocks per chunk; prints the a2a share, the share hidden, serial/overlapped.
  local moe=(--tokens 4096 --hidden 2048 --ffn 256 --shared-ffn 512 --experts 16 --top-k 8 --layers 2
             --json "$RES/$d/moe_overlap.json")
  [ "$DRY" = 1 ] && moe=(--device cpu --tokens 64 --hidden 32 --ffn 16 --shared-ffn 16 --experts 4 --top-k 2
             --layers 2 --warmup 1 --iters 2 --json "$RES/$d/moe_overlap.json")
  run "$d" moe_overlap 120 "${BENCH2[@]}" -m benchmarks.moe_overlap "${moe[@]}" \
    && show "$RES/$d/moe_overlap.log" 6 "hidden|share|serial|overlap"

  # Run 2: the simulator on the h200 profile, same config and overrides, next to the measured step.
  local s=run2_predict
  for name in pp2_ib_overlap pp2_ib_plain pp2_zero_bubble pp2_dualpipev ep2; do
    # shellcheck disable=SC2206
    local sets=(${LAYOUT[$name]})
    run "$s" "$name" 60 "${SIM[@]}" "$cfg" "${sets[@]}" --json "$RES/$s/$name.json" \
      && summary sim "$name" "$RES/$s/$name.json" "$RES/$d/$name.json"
  done
}

# ---------------------------------------------------------------------------------------------
corpus() {  # corpus PATH BYTES: text from the first .py files of the installed torch (#11's run)
  [ -s "$1" ] || [ "$PRINT" = 1 ] && return 0
  $PY - "$1" "$2" <<'EOF'
import pathlib, sys, torch
out, limit = pathlib.Path(sys.argv[1]), int(sys.argv[2])
parts, size = [], 0
for f in sorted(pathlib.Path(torch.__file__).parent.rglob("*.py")):
    text = f.read_text(errors="replace")
    parts.append(text); size += len(text.encode())
    if size >= limit:
        break
out.write_text("".join(parts))
print(f"corpus {out}: {out.stat().st_size:,} bytes from {len(parts)} files")
EOF
}

part2() {
  local cfg=configs/gpu_cp2_bf16_numerics.yaml d=run3_bf16 steps=100
  CORPUS=$RES/corpus.txt
  corpus "$CORPUS" 8000000 | tee -a "$RES/summary.txt"
  local dry=()
  [ "$DRY" = 1 ] && { dry=(--set data.seq_len=128 --set model.intermediate_size=64); steps=3; }
  read_tiny
  local common=(--compare-single --quiet --steps "$steps" --set "data.corpus=$CORPUS" "${DEV[@]}" "${dry[@]}" "${TINY[@]}")
  run "$d" p2p 170 "${TRAIN2[@]}" "$cfg" "${common[@]}" --metrics "$RES/$d/p2p.json" \
    --set train.accelerator.linear_attention_cp_mode=p2p --set train.accelerator.full_attention_cp_mode=ring \
    && summary train "CP2 p2p+ring vs one GPU (goal: at the floor, and 3.7e-4 loss rel)" "$RES/$d/p2p.json"
  run "$d" ulysses 170 "${TRAIN2[@]}" "$cfg" "${common[@]}" --metrics "$RES/$d/ulysses.json" \
    --set train.accelerator.linear_attention_cp_mode=ulysses --set train.accelerator.full_attention_cp_mode=ulysses \
    && summary train "CP2 ulysses vs one GPU" "$RES/$d/ulysses.json"
  run "$d" floor 170 "${TRAIN1[@]}" "$cfg" "${common[@]}" --metrics "$RES/$d/floor.json" \
    --set train.accelerator.world_size=1 --set train.accelerator.cp=1 \
    && summary train "noise floor: one GPU vs one GPU" "$RES/$d/floor.json"

  # Run 5: 10 steps under cp2 with a checkpoint at step 5 (the straight run), then steps 6..10
  # again from that checkpoint under cp1 on one GPU: the same losses.
  local c=run5_checkpoint ck=$RES/run5_checkpoint/ckpt csteps=10
  rm -rf "$ck"
  local ckd=()
  [ "$DRY" = 1 ] && { ckd=(--set data.seq_len=128 --set model.intermediate_size=64); csteps=4; }
  local cka=(configs/gpu_cp2_16k.yaml --quiet --set "data.corpus=$CORPUS" "${DEV[@]}" "${ckd[@]}" "${TINY[@]}"
             --set "checkpoint.dir=$ck" --set "checkpoint.interval=$((csteps / 2))" --set checkpoint.keep_last=2)
  run "$c" save_cp2 150 "${TRAIN2[@]}" "${cka[@]}" --steps "$csteps" --metrics "$RES/$c/save_cp2.json" \
    && summary train "cp2 straight (saves at step $((csteps / 2)))" "$RES/$c/save_cp2.json" \
    && run "$c" resume_cp1 150 "${TRAIN1[@]}" "${cka[@]}" --steps "$csteps" --metrics "$RES/$c/resume_cp1.json" \
      --set train.accelerator.world_size=1 --set train.accelerator.cp=1 \
      --resume "$ck/step-$(printf '%08d' $((csteps / 2)))" \
    && summary resume "cp2 checkpoint resumed under cp1" "$RES/$c/save_cp2.json" "$RES/$c/resume_cp1.json"
}

# ---------------------------------------------------------------------------------------------
part3() {
  local d=run4_cp
  local gdn=(--local-seq 16384 32768 65536 --modes p2p ulysses --json "$RES/$d/gdn_cp_gpu.json")
  local att=(--seq 32768 65536 --json "$RES/$d/attention_cp.json")
  local tcp=(configs/gpu_cp2_16k.yaml --modes ulysses p2p --warmup 2 --steps 5 --align-steps 0
             --json "$RES/$d/train_cp.json")
  [ "$DRY" = 1 ] && { gdn=(--device cpu --smoke --modes p2p ulysses --json "$RES/$d/gdn_cp_gpu.json");
    att=(--device cpu --seq 256 --heads 4 --dim 16 --warmup 1 --iters 2 --json "$RES/$d/attention_cp.json");
    tcp=(--smoke --modes ulysses p2p --warmup 1 --steps 1 --align-steps 0 --json "$RES/$d/train_cp.json"); }
  run "$d" gdn_cp_gpu 200 "${BENCH2[@]}" -m benchmarks.gdn_cp_gpu "${gdn[@]}" \
    && show "$RES/$d/gdn_cp_gpu.log" 12
  run "$d" attention_cp 120 "${BENCH2[@]}" -m benchmarks.attention_cp "${att[@]}" \
    && show "$RES/$d/attention_cp.log" 10
  run "$d" train_cp 150 "${BENCH2[@]}" -m benchmarks.train_cp "${tcp[@]}" \
    && show "$RES/$d/train_cp.log" 6

  # The whole-model step with the log-round prefix (prefix_scan) GDN CP, and a packed batch.
  local steps=8 dry=()
  [ "$DRY" = 1 ] && { dry=(--set data.seq_len=128 --set model.intermediate_size=64); steps=3; }
  read_tiny
  run "$d" prefix_scan 120 "${TRAIN2[@]}" configs/gpu_cp2_16k.yaml --quiet --steps "$steps" \
    "${DEV[@]}" "${dry[@]}" "${TINY[@]}" --metrics "$RES/$d/prefix_scan.json" \
    --set train.accelerator.linear_attention_cp_mode=prefix_scan \
    && summary train "whole model CP2, GDN prefix_scan" "$RES/$d/prefix_scan.json"
  # Packed (THD): the torch .py files as JSONL documents, reset at document boundaries.
  local docs=$RES/$d/docs.jsonl
  [ -s "$docs" ] || [ "$PRINT" = 1 ] || $PY - "$docs" <<'EOF'
import json, pathlib, sys, torch
files = sorted(pathlib.Path(torch.__file__).parent.rglob("*.py"))[:3000]
with open(sys.argv[1], "w") as fh:
    for f in files:
        fh.write(json.dumps({"text": f.read_text(errors="replace")}) + "\n")
EOF
  run "$d" packed 120 "${TRAIN2[@]}" configs/gpu_cp2_16k.yaml --quiet --steps "$steps" \
    "${DEV[@]}" "${dry[@]}" "${TINY[@]}" --metrics "$RES/$d/packed.json" \
    --set "data.files=[$docs]" --set data.packing=reset_at_document_boundaries \
    --set train.accelerator.linear_attention_cp_mode=p2p --set train.accelerator.full_attention_cp_mode=ring \
    --set train.validate_step_graph=false \
    && summary train "whole model CP2 p2p+ring, packed documents (THD)" "$RES/$d/packed.json"
}

[ "$PRINT" = 1 ] && { bundle() { :; }; }
"$PART"
say "== gpu_pair.sh $PART done $(date -u +%FT%TZ)"
bundle
