#!/bin/bash
# The Triton split-KV decode attention on one H200 (issue 10): its GPU tests, then
# bench/decode_attention.py (Triton vs XQA vs the FA2 sink wrapper). From the checkout root after
# `source .gpu/setup.sh`:
#     OUT=/tmp/out bash bench/device_decode_attention.sh
# FlashInfer's XQA modules build in the background (~45 s each when not cached) while the tests
# that need no XQA run. TILINGS: extra Triton tilings for the benchmark (block_n/min_keys/num_warps,
# comma-separated, e.g. 32/32/4,128/128/8). NCU_CONTEXTS (e.g. 8192,32768): also profile the cluster
# kernel at one request of each context with Nsight Compute's warp-state sampling per SASS instruction
# ($OUT/ncu_CTX.ncu-rep for the UI, summarised by bench/ncu_source.py into $OUT/ncu_CTX.txt). TRACE=1:
# also whether a dependent launch is placed early (bench/pdl_chain.py --overlap) and the cluster kernel
# warp by warp, alone and behind the kernels before it (bench/attention_trace.py). Logs, the
# benchmark's JSON and refreshed build caches (bench/device_caches.sh) go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[decode-attention $(date +%T) +${SECONDS}s] $*"; }
source bench/device_caches.sh

( for t in xqa-full xqa-window; do python3 -m pdserve.bench.kernels --warm-jit $t > "$OUT/warm_$t.log" 2>&1 & done; wait ) &
xqa_pid=$!
T=tests/gpu/test_triton_decode_attention_gpu.py
log "GPU tests without XQA"
python3 -m pytest -q -m gpu "$T" -k "not xqa" 2>&1 | tail -20 | tee "$OUT/tests.log"
wait "$xqa_pid"
grep -h -E "warm-jit|Error" "$OUT"/warm_*.log
log "GPU tests against XQA"
python3 -m pytest -q -m gpu "$T" -k xqa 2>&1 | tail -20 | tee -a "$OUT/tests.log"
log "benchmark"
timeout 300 python3 -m pdserve.bench.decode_attention ${TILINGS:+--tilings "$TILINGS"} \
  --out "$OUT/decode_attention.json" 2>&1 | tee "$OUT/bench.log"
if [ "${TRACE:-0}" = 1 ]; then
  log "when a dependent launch is placed"
  timeout 120 python3 -m pdserve.bench.pdl_chain --overlap --out "$OUT/overlap.json" 2>&1 | tee "$OUT/overlap.log"
  log "the cluster kernel warp by warp"
  timeout 300 python3 -m pdserve.bench.attention_trace --contexts 1024,8192,32768 --batches 1,2 \
    --out "$OUT/trace.json" > "$OUT/trace.log" 2>&1
  grep -v '^ ' "$OUT/trace.log" | cut -c1-400
fi
for ctx in $(echo "${NCU_CONTEXTS:-}" | tr ',' ' '); do
  log "Nsight Compute, one request at $ctx keys"
  # skip the first two launches (the build, the first run), profile the third
  timeout 300 ncu --clock-control none -k regex:^decode_attention$ --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
    -f -o "$OUT/ncu_$ctx" python3 -m pdserve.bench.decode_attention --launches 4 --batches 1 --contexts "$ctx" \
    > "$OUT/ncu_$ctx.log" 2>&1
  ncu --import "$OUT/ncu_$ctx.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_$ctx.csv" 2>&1
  # one request: 8 KV heads x 16 CTAs of 4 warps
  python3 -m pdserve.bench.ncu_source "$OUT/ncu_$ctx.csv" --warps 512 | tee "$OUT/ncu_$ctx.txt" | head -12
done
save_caches
log "done"
