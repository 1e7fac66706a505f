#!/bin/bash
# Device-machine driver for the parallelism runs (2 GPUs), one mode per call, logs under $OUT.
# Two calls because one upload (64 MiB) cannot carry both .gpu (FlashInfer & co., ~56 MB) and .whl
# (the NIXL CUDA 13 wheels, ~56 MiB). From the repo root on the device (docs/parallel-device.md):
#   nccl (carry .gpu): source .gpu/setup.sh || exit 1; bash bench/device_parallel.sh nccl [PYTEST ARGS]
#       TP2 and EP2 x TP1 logits of a 20b-shaped model against TP1 (tests/gpu/test_parallel_gpu.py);
#       FlashInfer attention, Triton FP8 experts; restores the FlashInfer/Triton build caches that
#       .gpu holds (as bench/device_session.sh does) and writes refreshed ones to $OUT.
#   nixl (carry .whl): bash bench/device_parallel.sh nixl [BENCH ARGS]
#       installs .whl/*.whl into /tmp/site, runs the VRAM KV-transfer test, then
#       bench/kvtransfer.py --device cuda, whose section it writes into $OUT/performance.md (a copy
#       of docs/performance.md) with $OUT/kvtransfer.json. UCX picks its transports (cuda_ipc).
# Budgets (seconds, under the 600 s a device command may run): TEST_TIMEOUT, VRAM_TIMEOUT, BENCH_TIMEOUT.
set -u
mode=${1:-}
shift || true
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[device-parallel $(date +%T)] $*"; }

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
}

gpus() {
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
  nvidia-smi topo -m 2>/dev/null | head -4
  python3 -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, 'sees', n, 'GPUs'); exit(0 if n >= 2 else 3)" \
    || log "WARNING: fewer than 2 GPUs visible: the NCCL tests skip, the bench puts every rank on cuda:0"
}

case "$mode" in
nccl)
  python3 -c "import flashinfer, triton" 2>/dev/null \
    || { log "FlashInfer/Triton not importable: run 'source .gpu/setup.sh' first (carry .gpu)"; exit 1; }
  gpus
  source bench/device_caches.sh
  log "NCCL layouts test (budget ${TEST_TIMEOUT:-540} s)"
  set -o pipefail
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -m gpu tests/gpu/test_parallel_gpu.py -rP -s \
    -p no:cacheprovider --durations=5 "$@" 2>&1 | tee "$OUT/parallel_gpu.log"
  rc=$?
  grep -h "^\[parallel-gpu\]" "$OUT/parallel_gpu.log" > "$OUT/parallel_gpu_figures.txt"
  save_caches
  log "done (rc=$rc); figures in $OUT/parallel_gpu_figures.txt"
  exit $rc
  ;;
nixl)
  ls .whl/nixl-*.whl .whl/nixl_cu13-*.whl > /dev/null 2>&1 \
    || { log "no NIXL wheels in .whl/ (carry .whl; docs/parallel-device.md says how to fetch them)"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { log "pip install of .whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # the meta package picks nixl_cu13 from torch's CUDA version; UCX's cuda transports need the driver's
  # libcuda.so.1 and libnvidia-ml.so.1 only
  python3 -c "import torch, nixl; from nixl._api import nixl_agent; print('nixl backend', nixl._pkg.__name__, '| torch', torch.__version__, torch.version.cuda)" \
    || { log "import nixl failed"; exit 1; }
  gpus
  log "UCX_TLS=${UCX_TLS:-<UCX default>}"
  set -o pipefail
  log "VRAM KV-transfer test"
  timeout "${VRAM_TIMEOUT:-150}" python3 -m pytest -m gpu tests/test_kvtransfer.py -k vram -rP -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/kvtransfer_gpu_test.log"
  log "VRAM test rc=$?"
  cp docs/performance.md "$OUT/performance.md"
  export PDSERVE_BENCH_COMMAND="bash bench/device_parallel.sh nixl${*:+ $*}"
  log "KV transfer bench (budget ${BENCH_TIMEOUT:-400} s)"
  timeout "${BENCH_TIMEOUT:-400}" python3 bench/kvtransfer.py --device cuda --doc "$OUT/performance.md" \
    --json "$OUT/kvtransfer.json" "$@" 2>&1 | tee "$OUT/kvtransfer.log"
  rc=$?
  log "done (rc=$rc); section in $OUT/performance.md"
  exit $rc
  ;;
*)
  usage
  exit 2
  ;;
esac
