#!/bin/bash
# The 120b decode step at one request and 8k keys on one GPU (issue 10), in one run: a random 120b checkpoint of
# 8 layers in the published layout (reused for 36 by --layers), GPU tests, the occupancy of one layer's
# attention half (bench/occupancy.py), bench/launch_ab.py on 8 layers with --timeline (optionally with every
# kernel asking for all shared memory), on 36 layers, and the whole GPU suite in five lists side by side.
# From the checkout root on a GPU host, after `source .gpu/setup.sh` (see bench/device_pkg.sh):
#     OUT=/tmp/out STEPS=ckpt,tests,occ,ab8,ab36 SET="default,qkv 16 rows" bash bench/device_step120.sh
# STEPS (comma list): ckpt, tests ($TESTS, pytest -k $K), occ, ab8 ($SET), ab8c ($SETC under
# PDSERVE_SMEM_CARVEOUT=$CARVE), ab36 ($SET36, under $CARVE36 where set), suite.
# Time limits (seconds): TT (tests), TAB (each 8-layer run), T36, TS (each suite list). Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-ckpt,ab8,ab36}
CK=${CKPT120:-/tmp/ckpt120}
log() { echo "[step120 $(date +%T) +${SECONDS}s] $*"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
source bench/device_caches.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader

if has ckpt && [ ! -f "$CK/config.json" ]; then
  python3 - "$CK" > "$OUT/ckpt.log" 2>&1 <<'PY' &
import sys
from dataclasses import replace
from pdserve.engine.checkpoint_writer import make_random_checkpoint
from pdserve.engine.config import preset
make_random_checkpoint(sys.argv[1], replace(preset("120b"), num_hidden_layers=8, layer_types=()), seed=0, workers=14)
print("checkpoint written")
PY
  ckpt_pid=$!
fi
if has tests; then
  timeout "${TT:-200}" python3 -m pytest -m gpu ${TESTS:-tests/gpu/test_gemv_fp8_gpu.py} ${K:+-k "$K"} -q -rfEs \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
  log "tests rc=$? $(tail -1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
if has occ; then
  python3 -m pdserve.bench.occupancy > "$OUT/occupancy.log" 2>&1
  log "occupancy rc=$?"; cat "$OUT/occupancy.log"
fi
[ -n "${ckpt_pid:-}" ] && { wait "$ckpt_pid"; log "$(tail -1 "$OUT/ckpt.log")"; }

AB="python3 -m pdserve.bench.launch_ab --ckpt $CK --precision mxfp4 --fp8 --controls 1 --context 8192 --batches 1"
if has ab8; then
  timeout "${TAB:-200}" $AB --timeline --settings "${SET:-default}" > "$OUT/ab8.log" 2>&1
  log "ab8 rc=$?"; grep -v "^\[" "$OUT/ab8.log" | tail -60
fi
if has ab8c; then
  PDSERVE_SMEM_CARVEOUT="${CARVE:-decode_attention=100,gemv_fp8_rope=100}" timeout "${TAB:-200}" \
    $AB --timeline --settings "${SETC:-${SET:-default}}" > "$OUT/ab8c.log" 2>&1
  log "ab8c rc=$?"; grep -v "^\[" "$OUT/ab8c.log" | tail -60
fi
if has ab36; then
  ${CARVE36:+env PDSERVE_SMEM_CARVEOUT=$CARVE36} timeout "${T36:-200}" \
    $AB --layers 36 --kv-blocks 1200 --rounds 5 --settings "${SET36:-default}" > "$OUT/ab36.log" 2>&1
  log "ab36 rc=$?"; grep -v "^\[" "$OUT/ab36.log" | tail -20
fi
if has suite; then
  lists=(
    "tests/gpu/test_moe_mxfp4_mma_gpu.py"
    "tests/gpu/test_gemv_fp8_gpu.py tests/gpu/test_fp8_linear_gpu.py"
    "tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_attention_gpu.py tests/gpu/test_triton_decode_attention_gpu.py tests/gpu/test_engine_graphs_gpu.py tests/gpu/test_cuda_decode_attention_gpu.py"
    "tests/gpu/test_moe_mxfp4_gpu.py tests/gpu/test_bf16_gemv_gpu.py tests/gpu/test_gemv_staged_gpu.py tests/gpu/test_argmax_gpu.py tests/gpu/test_parallel_gpu.py tests/gpu/test_parallel_graphs_gpu.py tests/gpu/test_deepgemm_moe_gpu.py"
    "tests/gpu/test_moe_gpu.py tests/gpu/test_moe_mxfp4_grouped_gpu.py tests/gpu/test_pdl_gpu.py tests/gpu/test_sampling_gpu.py tests/gpu/test_step_io_gpu.py tests/gpu/test_repeated_layers_gpu.py tests/gpu/test_decode_worker_pipeline_gpu.py"
  )
  listed=$(printf '%s\n' "${lists[@]}" | tr ' ' '\n' | sort)
  missing=$(comm -23 <(ls tests/gpu/test_*.py | sort) <(echo "$listed"))
  [ -n "$missing" ] && log "not in a suite list: $missing"
  pids=()
  for i in "${!lists[@]}"; do
    timeout "${TS:-330}" python3 -m pytest -m gpu ${lists[$i]} -q -rfEs -p no:cacheprovider > "$OUT/suite$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for i in "${!lists[@]}"; do
    log "suite list $i: $(tail -1 "$OUT/suite$i.log")"; grep -E "^(FAILED|ERROR)" "$OUT/suite$i.log" | head -10
  done
fi
log done
