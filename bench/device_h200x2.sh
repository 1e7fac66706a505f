#!/bin/bash
# One device call on a 2-GPU H200 host (kind nvidia-h200-x2, carry .gpu) for the kernel and
# engine work, the two GPUs used as two independent lanes so the call fits its 600 s:
#   CPU, background : a random 20b checkpoint (bench.model.ensure_checkpoint, parallel writer),
#                     DeepGEMM built from source (bench/build_deepgemm.sh), FlashInfer modules
#   GPU 0           : pytest -m gpu (MoE, attention, CUDA-graph engine), then bench.kernels gemv,moe
#                     (grouped and GEMV decode paths), then bench.kernels gemm (vs DeepGEMM)
#   GPU 1           : bench.kernels attention, then bench/engine_gpu.py (20b shape, 24 layers:
#                     logits vs the torch path, prefill 8k, decode eager and CUDA graphs)
# Each bench writes JSON under $OUT; merge the kernel tables on the workstation with
#   python -m bench.kernels --merge-json DIR --doc docs/performance.md
# Usage (repo root, device): source .gpu/setup.sh || exit 1; bash bench/device_h200x2.sh
set -u
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-560}  # seconds for the whole script
log() { echo "[h200x2 $(date +%T) +${SECONDS}s] $*"; }
left() { echo $(( BUDGET - SECONDS - ${1:-0} )); }
wait_file() {  # wait_file PATH SECONDS_RESERVED: poll until the file exists or time runs out
  while [ ! -f "$1" ] && [ "$(left "$2")" -gt 0 ]; do sleep 2; done
  [ -f "$1" ]
}

site=${GPU_SITE:-/tmp/gpu-site}
aot="$site/flashinfer/data/aot"
mkdir -p "$aot"
[ -f .gpu/pdserve-fi-jit.tar.gz ] && tar -xzf .gpu/pdserve-fi-jit.tar.gz -C "$aot" && log "restored FlashInfer modules"
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpu/pdserve-triton.tar.gz ] && tar -xzf .gpu/pdserve-triton.tar.gz -C "$TRITON_CACHE_DIR" && log "restored Triton cache"
if ls .gpu/dg/apache_tvm_ffi-0.1.11*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tvm011 .gpu/dg/apache_tvm_ffi-0.1.11*.whl \
    && export DG_TVM_FFI_SITE=/tmp/tvm011
fi
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
export PDSERVE_CKPT_ROOT=/tmp/ckpt
CKPT20=$PDSERVE_CKPT_ROOT/20b-mxfp4-seed0

# -- CPU, background ---------------------------------------------------------------------------
( python3 -c "
from pathlib import Path
from bench.model import ensure_checkpoint
p, why = ensure_checkpoint('20b', Path('$PDSERVE_CKPT_ROOT'))
print(p, why)
" > "$OUT/ckpt.log" 2>&1; touch /tmp/ckpt20.done ) &
( bash bench/build_deepgemm.sh > "$OUT/deepgemm_build.log" 2>&1; echo $? > /tmp/dg.rc ) &
for target in xqa-full xqa-window plain-fa2 plain-fa3; do
  python3 -m bench.kernels --warm-jit "$target" > "/tmp/warm_$target.log" 2>&1 &
done

# -- GPU 0 --------------------------------------------------------------------------------------
(
  export CUDA_VISIBLE_DEVICES=0
  log "gpu0: pytest"
  timeout "$(left 330)" python3 -m pytest -m gpu tests/gpu/test_moe_gpu.py tests/gpu/test_attention_gpu.py \
    tests/gpu/test_engine_graphs_gpu.py -q -rsP -s --durations=10 -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  log "gpu0: pytest rc=$? ($(tail -1 "$OUT/pytest.log"))"
  timeout "$(left 150)" python3 -m bench.kernels --sections gemv,moe --json "$OUT/bench_moe.json" > "$OUT/bench_moe.log" 2>&1
  log "gpu0: bench moe rc=$?"
  if wait_file /tmp/dg.rc 60 && [ "$(cat /tmp/dg.rc)" = 0 ]; then
    export DG_SITE=/tmp/dg-site DG_CHILD_TIMEOUT=$(left 40)
  else
    log "gpu0: DeepGEMM build not ready (rc=$(cat /tmp/dg.rc 2>/dev/null || echo running)); gemm section without it"
  fi
  timeout "$(left 15)" python3 -m bench.kernels --sections gemm --json "$OUT/bench_gemm.json" > "$OUT/bench_gemm.log" 2>&1
  log "gpu0: bench gemm rc=$?"
) &
lane0=$!

# -- GPU 1 --------------------------------------------------------------------------------------
(
  export CUDA_VISIBLE_DEVICES=1
  sleep 20  # let the FlashInfer warm-up builds start first
  timeout "$(left 300)" python3 -m bench.kernels --sections attention --json "$OUT/bench_attention.json" \
    > "$OUT/bench_attention.log" 2>&1
  log "gpu1: bench attention rc=$?"
  if wait_file /tmp/ckpt20.done 120; then
    mkdir -p /tmp/ckpt-eg && ln -sfn "$CKPT20" /tmp/ckpt-eg/20b-24
    timeout "$(left 10)" python3 bench/engine_gpu.py --preset 20b --ckpt /tmp/ckpt-eg --out "$OUT" \
      --record "$OUT/engine_gpu.md" > "$OUT/engine_gpu.log" 2>&1
    log "gpu1: engine_gpu rc=$?"
  else
    log "gpu1: checkpoint not ready; engine_gpu skipped"
  fi
) &
lane1=$!

wait $lane0 $lane1
cat /tmp/warm_*.log > "$OUT/warm.log" 2>/dev/null
ops=$(find "${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}" -type d -name cached_ops 2>/dev/null | head -1)
if [ -n "$ops" ]; then
  (cd "$ops" && tar -czf "$OUT/pdserve-fi-jit.tar.gz" $(ls -d */ 2>/dev/null | while read d; do d=${d%/}; [ -f "$d/$d.so" ] && echo "$d/$d.so"; done) 2>/dev/null)
fi
(cd "$TRITON_CACHE_DIR" && tar -czf "$OUT/pdserve-triton.tar.gz" . 2>/dev/null)
log "summary"
tail -3 "$OUT/pytest.log"
grep -h -E "^decode|^prefill|^logits|graph vs eager" "$OUT/engine_gpu.log" 2>/dev/null
tail -5 "$OUT/deepgemm_build.log" 2>/dev/null
ls -la "$OUT"
