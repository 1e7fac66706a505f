#!/bin/bash
# Decode-step session on one H200 (issue 10): GPU tests of the decode path, then
# bench/engine_gpu.py on a random 20b checkpoint with the fused per-layer kernels off and on, with
# the per-category profile. Run from the checkout root after `source .gpu/setup.sh`:
#     OUT=/tmp/out STEPS=tests,bench bash bench/device_decode.sh
# STEPS: tests (tests/gpu/$TESTS), bench (engine_gpu --compare-fused --profile), mxfp4
# (bench/moe_mxfp4.py), peer (engine_gpu --peer-triton: OpenAI's gpt_oss.triton on the same weights,
# decode at batch 1 and 64; triton_kernels from $TRITON_KERNELS_DIR, default .gpu/triton_kernels), engmx
# (engine_gpu at batch 1, 16, 32, 64 ($MX_BATCHES) with FP8, then MXFP4 experts, the default
# dispatch of kernels.moe). MX_ARGS: extra arguments of bench/moe_mxfp4.py (e.g. "--configs mma,grouped
# --tokens 1,4,16,64"), MX_ENGINE_ARGS: of the engine runs (e.g. "--mxfp4-mma-max-tokens 0"), dec120
# (120b with $LAYERS120 layers, default 8, batch 1 at context 8192, FP8 then MXFP4 experts; scale per
# layer for the 36-layer figure), mxncu (Nsight Compute on the one-token MXFP4 mma kernels, warp
# states sampled per SASS instruction: $W/mx_t1.ncu-rep for the Nsight Compute UI's Source page), ab
# (bench/launch_ab.py: the step's graph with PDL off / on / on + the one-launch QKV epilogue,
# interleaved, FP8 then MXFP4 experts, batches $AB_BATCHES, default 1,64).
# BUDGET: seconds.
# Logs and results go to $OUT/decode.tgz; build caches to $OUT (see bench/device_caches.sh).
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/wdec
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-tests,bench,peer}
BUDGET=${BUDGET:-540}
TESTS=${TESTS:-"tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_engine_graphs_gpu.py"}
BENCH_ARGS=${BENCH_ARGS:-"--compare-fused --profile"}
log() { echo "[decode $(date +%T) +${SECONDS}s] $*"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
left() { local v=$(( BUDGET - SECONDS - ${1:-0} )); [ "$v" -lt 1 ] && v=1; echo "$v"; }
pack() { tar -czf "$OUT/decode.tgz" -C "$W" . 2>/dev/null; }

source bench/device_caches.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee "$W/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$W/env.log"

# the checkpoint and the XQA decode modules build in the background while the tests run
if { has bench || has peer || has engmx || has ab; } && [ ! -f /tmp/ckpt/20b-mxfp4-seed0/config.json ]; then
  ( python3 -c "
from pathlib import Path
from bench.model import ensure_checkpoint
print(*ensure_checkpoint('20b', Path('/tmp/ckpt')))
" > "$W/ckpt20.log" 2>&1 ) &
  ckpt_pid=$!
fi
( for t in xqa-full xqa-window; do python3 -m bench.kernels --warm-jit $t > "$W/warm_$t.log" 2>&1 & done; wait ) &
xqa_pid=$!

if has tests; then
  # tests that need no XQA module first
  timeout "$(left 300)" python3 -m pytest -m gpu tests/gpu/test_fused_kernels_gpu.py -q -rfEs -p no:cacheprovider \
    > "$W/pytest_fused.log" 2>&1
  log "fused kernel tests rc=$? ($(tail -1 "$W/pytest_fused.log"))"
  grep -E "^(FAILED|ERROR)|Error|assert" "$W/pytest_fused.log" | head -20
  wait $xqa_pid
  rest=$(echo $TESTS | tr ' ' '\n' | grep -v test_fused_kernels_gpu.py | tr '\n' ' ')
  if [ -n "$rest" ]; then
    timeout "$(left 240)" python3 -m pytest -m gpu $rest -q -rfEs -p no:cacheprovider > "$W/pytest.log" 2>&1
    log "tests rc=$? ($(tail -1 "$W/pytest.log"))"
    grep -E "^(FAILED|ERROR)" "$W/pytest.log" | head -10
  fi
  pack
fi

if has mxfp4; then
  timeout "$(left 15)" python3 bench/moe_mxfp4.py --out "$W/moe_mxfp4.json" ${MX_ARGS:-} > "$W/moe_mxfp4.log" 2>&1
  log "moe_mxfp4 rc=$?"
  grep -E "^T=|copy|Error" "$W/moe_mxfp4.log" | tail -60
  pack
fi
if has mxncu; then
  # skip the eager warm-up launches (8 rounds of gate/up + down), profile one round's two kernels
  timeout "$(left 15)" ncu --clock-control none -k regex:mx_ --launch-skip 16 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
    --import-source yes -f -o "$W/mx_t1" \
    python3 bench/moe_mxfp4.py --no-fp8 --configs "mma pair gu4k1d2 dn4k2d2" --tokens 1 > "$W/mxncu.log" 2>&1
  log "ncu rc=$?"
  ncu --import "$W/mx_t1.ncu-rep" --page details > "$W/mx_t1_details.txt" 2>&1
  grep -E "mx_|Duration|DRAM Throughput|Warp Cycles Per Issued|Stall|Issued Warp" "$W/mx_t1_details.txt" | head -60
  pack
fi
if has bench || has peer || has engmx || has ab; then
  [ -n "${ckpt_pid:-}" ] && wait "$ckpt_pid"
  wait $xqa_pid 2>/dev/null
  tail -1 "$W/ckpt20.log" 2>/dev/null
  mkdir -p /tmp/ckpt-eg "$W/eg" "$W/peer" && ln -sfn /tmp/ckpt/20b-mxfp4-seed0 /tmp/ckpt-eg/20b-24
  log "checkpoint ready"
fi
if has bench; then
  timeout "$(left 20)" python3 bench/engine_gpu.py --preset 20b --ckpt /tmp/ckpt-eg --out "$W/eg" \
    --record "$W/eg/performance.md" $BENCH_ARGS > "$W/eg.log" 2>&1
  log "engine_gpu rc=$?"
  grep -vE "^\s*$|Warning|warn" "$W/eg.log" | tail -60
  pack
fi
if has peer; then
  # short pdserve part (1k prefill, 16 decode steps), then the peer on the same weights
  tk=$(readlink -f "${TRITON_KERNELS_DIR:-${PDSERVE_GPU_CACHE:-.gpu}/triton_kernels}")
  PYTHONPATH=$tk${PYTHONPATH:+:$PYTHONPATH} timeout "$(left 15)" python3 bench/engine_gpu.py \
    --preset 20b --ckpt /tmp/ckpt-eg --out "$W/peer" --record "$W/peer/performance.md" --prefill-tokens 1024 \
    --decode-steps 16 --batches 1,64 --peer-triton > "$W/peer.log" 2>&1
  log "engine_gpu --peer-triton rc=$?"
  grep -vE "^\s*$|Warning|warn" "$W/peer.log" | tail -25
  pack
fi
if has engmx; then
  for prec in fp8 mxfp4; do
    timeout "$(left 10)" python3 bench/engine_gpu.py --preset 20b --ckpt /tmp/ckpt-eg --out "$W/eg_$prec" \
      --record "$W/eg_$prec/performance.md" --precision $prec --check-tokens 64 --prefill-tokens 1024 \
      --decode-steps 32 --batches ${MX_BATCHES:-1,16,32,64} ${MX_ENGINE_ARGS:-} > "$W/eg_$prec.log" 2>&1
    log "engine_gpu $prec rc=$?"
    grep -vE "^\s*$|Warning|warn" "$W/eg_$prec.log" | grep -E "decode|prefill|step|rel|Error|error" | tail -20
    pack
  done
fi
if has ab; then
  for prec in fp8 mxfp4; do
    timeout "$(left 10)" python3 bench/launch_ab.py --ckpt /tmp/ckpt/20b-mxfp4-seed0 --precision $prec \
      --batches ${AB_BATCHES:-1,64} --controls 1 --out "$W/ab_$prec.json" > "$W/ab_$prec.log" 2>&1
    log "launch_ab $prec rc=$?"
    grep -E "^batch|Error" "$W/ab_$prec.log"
    pack
  done
fi
if has dec120; then
  for prec in fp8 mxfp4; do
    extra=""; [ $prec = mxfp4 ] && extra="${MX_ENGINE_ARGS:-}"
    mkdir -p "$W/dec120_$prec"
    timeout "$(left 10)" python3 bench/engine_gpu.py --preset 120b --layers "${LAYERS120:-8}" --ckpt /tmp/ckpt-eg \
      --out "$W/dec120_$prec" --precision $prec $extra --check-tokens 64 --prefill-tokens 1024 \
      --decode-context 8192 --decode-steps 16 --batches 1 > "$W/dec120_$prec.log" 2>&1
    log "engine_gpu 120b ${LAYERS120:-8} layers $prec rc=$?"
    grep -E "^decode|^prefill|Error|error" "$W/dec120_$prec.log" | tail -8
    pack
  done
fi
save_caches
pack
ls -la "$OUT"
log end
