#!/bin/bash
# Device calls on a 2-GPU H200 host (kind nvidia-h200-x2, carry .gpu), the two GPUs used as
# independent lanes where the steps allow, so that a call fits its 600 s. Steps ($STEPS, comma
# list; default "tests,kernels,engine"):
#   CPU, background : a random 20b checkpoint (bench.model.ensure_checkpoint, parallel writer) and,
#                     with `kernels`, DeepGEMM built from source (bench/build_deepgemm.sh)
#   tests   (GPU 0) : pytest -m gpu: MoE, attention, CUDA-graph engine
#   kernels (GPU 0) : bench.kernels moe then gemm (vs DeepGEMM); (GPU 1) attention
#   engine  (GPU 1) : bench/engine_gpu.py (20b shape, 24 layers: logits vs the torch path,
#                     prefill 8k, decode eager and from CUDA graphs)
#   nccl    (both)  : tests/gpu/test_parallel_gpu.py (TP2 and EP2 vs TP1 logits, NCCL)
#   model   (both)  : bench/model.py runs ($MODEL_RUNS, ';'-separated argument lists; default
#                     "--quick --models 20b") into $OUT/model; 120b checkpoint written early
# Logs go to $OUT/logs.tgz (a device call returns few files); JSON results to $OUT.
# Usage (repo root, device): source .gpu/setup.sh || exit 1; STEPS=... bash bench/device_h200x2.sh
set -u
OUT=${OUT:-/tmp/pdserve-out}
L=$OUT/l
mkdir -p "$L"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-tests,kernels,engine}
BUDGET=${BUDGET:-555}  # seconds for the whole script
log() { echo "[h200x2 $(date +%T) +${SECONDS}s] $*"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
left() { echo $(( BUDGET - SECONDS - ${1:-0} )); }
wait_file() {  # wait_file PATH SECONDS_RESERVED: poll until the file exists or time runs out
  while [ ! -f "$1" ] && [ "$(left "$2")" -gt 0 ]; do sleep 2; done
  [ -f "$1" ]
}

source bench/device_caches.sh
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
CKPT_ROOT=/tmp/ckpt
CKPT20=$CKPT_ROOT/20b-mxfp4-seed0

# -- CPU, background ---------------------------------------------------------------------------
( python3 -c "
from pathlib import Path
from bench.model import ensure_checkpoint
print(*ensure_checkpoint('20b', Path('$CKPT_ROOT')))
" > "$L/ckpt.log" 2>&1; touch /tmp/ckpt20.done ) &
if [[ ${MODEL_RUNS:-} == *120b* ]]; then
  ( python3 -c "
from pathlib import Path
from bench.model import ensure_checkpoint
print(*ensure_checkpoint('120b', Path('$CKPT_ROOT')))
" > "$L/ckpt120.log" 2>&1; touch /tmp/ckpt120.done ) &
fi
if has kernels; then
  ( bash bench/build_deepgemm.sh > "$L/deepgemm_build.log" 2>&1; echo $? > /tmp/dg.rc ) &
fi
for target in xqa-full xqa-window plain-fa2 plain-fa3; do
  python3 -m pdserve.bench.kernels --warm-jit "$target" > "/tmp/warm_$target.log" 2>&1 &
done

# -- GPU 0 --------------------------------------------------------------------------------------
(
  export CUDA_VISIBLE_DEVICES=0
  if has tests; then
    timeout "$(left 240)" python3 -m pytest -m gpu ${PYTEST_FILES:-tests/gpu/test_moe_gpu.py tests/gpu/test_attention_gpu.py \
      tests/gpu/test_engine_graphs_gpu.py} -q -rfEs -s --durations=10 -p no:cacheprovider > "$L/pytest.log" 2>&1
    log "gpu0: pytest rc=$? ($(tail -1 "$L/pytest.log"))"
  fi
  if has kernels; then
    timeout "$(left 150)" python3 -m pdserve.bench.kernels --sections moe --json "$OUT/bench_moe.json" > "$L/bench_moe.log" 2>&1
    log "gpu0: bench moe rc=$?"
    if wait_file /tmp/dg.rc 60 && [ "$(cat /tmp/dg.rc)" = 0 ]; then
      export DG_SITE=/tmp/dg-site DG_CHILD_TIMEOUT=$(left 40)
    fi
    timeout "$(left 15)" python3 -m pdserve.bench.kernels --sections gemm --json "$OUT/bench_gemm.json" > "$L/bench_gemm.log" 2>&1
    log "gpu0: bench gemm rc=$?"
  fi
) &
lane0=$!

# -- GPU 1 --------------------------------------------------------------------------------------
(
  export CUDA_VISIBLE_DEVICES=1
  if has kernels; then
    sleep 20  # let the FlashInfer warm-up builds start first
    timeout "$(left 300)" python3 -m pdserve.bench.kernels --sections attention --json "$OUT/bench_attention.json" \
      > "$L/bench_attention.log" 2>&1
    log "gpu1: bench attention rc=$?"
  fi
  if has engine && wait_file /tmp/ckpt20.done 200; then
    mkdir -p /tmp/ckpt-eg && ln -sfn "$CKPT20" /tmp/ckpt-eg/20b-24
    timeout "$(left 200)" python3 bench/engine_gpu.py --preset 20b --ckpt /tmp/ckpt-eg --out "$OUT" \
      --record "$OUT/engine_gpu.md" > "$L/engine_gpu.log" 2>&1
    log "gpu1: engine_gpu rc=$?"
  fi
) &
lane1=$!
wait $lane0 $lane1

# -- both GPUs ----------------------------------------------------------------------------------
if has nccl && wait_file /tmp/ckpt20.done 60; then
  PDSERVE_GPU_CKPT=$CKPT20 timeout "$(left 60)" python3 -m pytest -m gpu tests/gpu/test_parallel_gpu.py -rP -s \
    -p no:cacheprovider --durations=5 > "$L/nccl.log" 2>&1
  log "nccl rc=$?"
  grep -h "^\[parallel-gpu\]" "$L/nccl.log"
  tail -1 "$L/nccl.log"
fi
if has model; then
  # MODEL_RUNS: ';'-separated bench/model.py argument lists (default: the quick 20b sweep);
  # a 120b run waits for the checkpoint written in the background since the start
  IFS=';' read -ra runs <<< "${MODEL_RUNS:---quick --models 20b}"
  for args in "${runs[@]}"; do
    [[ $args == *120b* ]] && wait_file /tmp/ckpt120.done 60
    timeout "$(left 10)" python3 bench/model.py --device cuda --out "$OUT/model" $args \
      --ckpt-dir "$CKPT_ROOT" >> "$L/model.log" 2>&1
    log "model ($args) rc=$?"
  done
  grep "^\[bench\]" "$L/model.log" | tail -20
fi

cat /tmp/warm_*.log > "$L/warm.log" 2>/dev/null
save_caches
log "summary"
tail -3 "$L/pytest.log" 2>/dev/null
grep -h -E "FAILED|^E  " "$L/pytest.log" 2>/dev/null | head -20
grep -h -E "^decode|^prefill|^logits|graph vs eager" "$L/engine_gpu.log" 2>/dev/null
tail -4 "$L/deepgemm_build.log" 2>/dev/null
(cd "$OUT" && tar -czf logs.tgz l && rm -rf l)
ls -la "$OUT"
