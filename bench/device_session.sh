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
log() { echo "[session $(date +%T)] $*"; }
source bench/device_caches.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv

# FlashInfer modules that are not prebuilt: build each in its own process, in the background
pids=()
for target in xqa-full xqa-window plain-fa2 plain-fa3; do
  python3 -m pdserve.bench.kernels --warm-jit "$target" > "/tmp/warm_$target.log" 2>&1 &
  pids+=($!)
done

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
save_caches; ls -la "$OUT"
if [[ $steps == *bench* ]]; then
  log "bench"
  cp docs/performance.md "$OUT/performance.md" 2>/dev/null || true
  export PDSERVE_BENCH_COMMAND="source .gpu/setup.sh; bash bench/device_session.sh $steps $*"
  left=$(( ${SESSION_SECONDS:-560} - SECONDS - 25 ))
  log "bench budget ${left}s"
  timeout "$left" python3 -m pdserve.bench.kernels --doc "$OUT/performance.md" --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -120
  log "bench done"
  save_caches; ls -la "$OUT"
fi
