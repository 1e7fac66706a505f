#!/bin/bash
# One device-machine call for the kernels: GPU tests, then the kernel benchmark; logs under $OUT.
# From the repo root, on the device (see /work/shared/device/README.md, .gpu = that folder):
#   source .gpu/setup.sh || exit 1; export PYTHONUNBUFFERED=1; bash bench/device_session.sh [STEPS] [BENCH ARGS]
# STEPS: comma list of tests,bench (default tests,bench). Build caches that earlier calls brought
# back (.gpu/pdserve-fi-jit.tar.gz: FlashInfer modules; .gpu/pdserve-triton.tar.gz: Triton cache)
# are restored first, and refreshed copies are written to $OUT for the next call.
set -u
steps=${1:-tests,bench}
shift || true
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT"
site=${GPU_SITE:-/tmp/gpu-site}
log() { echo "[session $(date +%T)] $*"; }

aot="$site/flashinfer/data/aot"
mkdir -p "$aot"
[ -f .gpu/pdserve-fi-jit.tar.gz ] && tar -xzf .gpu/pdserve-fi-jit.tar.gz -C "$aot" && log "restored FlashInfer modules: $(ls "$aot" | tr '\n' ' ')"
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpu/pdserve-triton.tar.gz ] && tar -xzf .gpu/pdserve-triton.tar.gz -C "$TRITON_CACHE_DIR" && log "restored Triton cache"
if ls .gpu/dg/apache_tvm_ffi-0.1.11*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tvm011 .gpu/dg/apache_tvm_ffi-0.1.11*.whl \
    && export DG_TVM_FFI_SITE=/tmp/tvm011
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv

# FlashInfer modules that are not prebuilt: build each in its own process, in the background
pids=()
for target in xqa-full xqa-window plain-fa2 plain-fa3; do
  python3 -m bench.kernels --warm-jit "$target" > "/tmp/warm_$target.log" 2>&1 &
  pids+=($!)
done

save_caches() {
  local ops
  ops=$(find "${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}" -type d -name cached_ops 2>/dev/null | head -1)
  if [ -n "$ops" ]; then
    (cd "$ops" && tar -czf "$OUT/pdserve-fi-jit.tar.gz" $(ls -d */ 2>/dev/null | while read d; do d=${d%/}; [ -f "$d/$d.so" ] && echo "$d/$d.so"; done) 2>/dev/null)
  fi
  (cd "$TRITON_CACHE_DIR" && tar -czf "$OUT/pdserve-triton.tar.gz" . 2>/dev/null)
  ls -la "$OUT"
}

if [[ $steps == *tests* ]]; then
  log "tests"
  set -o pipefail
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu tests/gpu/test_moe_gpu.py tests/gpu/test_attention_gpu.py \
    -q -rsP --durations=8 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -60
  log "tests done (rc=$?)"
fi
for p in "${pids[@]}"; do wait "$p"; done
cat /tmp/warm_*.log > "$OUT/warm.log"
grep -h -E "warm-jit|Error" /tmp/warm_*.log | head -20
save_caches
if [[ $steps == *bench* ]]; then
  log "bench"
  cp docs/performance.md "$OUT/performance.md" 2>/dev/null || true
  export PDSERVE_BENCH_COMMAND="source .gpu/setup.sh; bash bench/device_session.sh $steps $*"
  left=$(( ${SESSION_SECONDS:-560} - SECONDS - 25 ))
  log "bench budget ${left}s"
  timeout "$left" python3 -m bench.kernels --doc "$OUT/performance.md" --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -120
  log "bench done"
  save_caches
fi
