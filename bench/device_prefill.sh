#!/bin/bash
# Prefill session on one H200 (issue 12): DeepGEMM built from source, the GPU tests of the MoE
# paths, the MoE layer at prefill sizes (Triton path vs DeepGEMM path vs DeepGEMM's GEMMs alone),
# then bench/engine_gpu.py's prefill with each MoE path and its per-category profile. Run from the
# checkout root after `source .gpu/setup.sh`:
#     OUT=/tmp/out STEPS=build,tests,kernels,engine bash bench/device_prefill.sh
# STEPS: ckpt (write the 20b checkpoint in the background), build (bench/build_deepgemm.sh into $DG_SITE), tests ($TESTS), kernels (bench.kernels
# --sections moe_prefill), engine (20b: 8k prompt, both MoE paths, profile; then a 32k prompt),
# engine120 (120b with $LAYERS120 layers, 8k prompt, both paths). BUDGET: seconds for the script.
# Logs and results go to $OUT/prefill.tgz.
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/wpre
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-build,tests,kernels,engine}
BUDGET=${BUDGET:-540}
LAYERS120=${LAYERS120:-9}
TESTS=${TESTS:-"tests/gpu/test_deepgemm_moe_gpu.py tests/gpu/test_moe_gpu.py"}
export DG_SITE=${DG_SITE:-/tmp/dg-site}
log() { echo "[prefill $(date +%T) +${SECONDS}s] $*"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
left() { local v=$(( BUDGET - SECONDS - ${1:-0} )); [ "$v" -lt 1 ] && v=1; echo "$v"; }
pack() { tar -czf "$OUT/prefill.tgz" -C "$W" . 2>/dev/null; }

source bench/device_caches.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee "$W/env.log"

# the 20b checkpoint is written in the background (its own session: with STEPS=ckpt it outlives this
# call, for the next call on the same machine) while DeepGEMM builds and the tests run
if { has engine || has engine120 || has ckpt; } && [ ! -f /tmp/ckpt/20b-mxfp4-seed0/config.json ] \
   && ! pgrep -f "ensure_checkpoint" > /dev/null; then
  setsid nohup python3 -c "
from pathlib import Path
from bench.model import ensure_checkpoint
print(*ensure_checkpoint('20b', Path('/tmp/ckpt')))
" > /tmp/ckpt20.log 2>&1 < /dev/null &
fi
wait_ckpt() {  # until the checkpoint is renamed into place (ensure_checkpoint writes it atomically)
  while [ ! -f /tmp/ckpt/20b-mxfp4-seed0/config.json ] && pgrep -f "ensure_checkpoint" > /dev/null; do sleep 2; done
  tail -1 /tmp/ckpt20.log 2>/dev/null
  mkdir -p /tmp/ckpt-eg && ln -sfn /tmp/ckpt/20b-mxfp4-seed0 /tmp/ckpt-eg/20b-24
}

if has build; then
  timeout "$(left 60)" bash bench/build_deepgemm.sh > "$W/build_deepgemm.log" 2>&1
  log "build_deepgemm rc=$?"
  tail -6 "$W/build_deepgemm.log"
fi
[ -f "$DG_SITE/deep_gemm/_C.so" ] && export PYTHONPATH=$DG_SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -c "from pdserve.kernels import deepgemm_moe as d; print('DeepGEMM MoE path available:', d.available())" | tee -a "$W/env.log"

if has tests; then
  timeout "$(left 200)" python3 -m pytest -m gpu $TESTS -q -rfEs -p no:cacheprovider > "$W/pytest.log" 2>&1
  log "tests rc=$? ($(tail -1 "$W/pytest.log"))"
  grep -E "^(FAILED|ERROR)|rel L2 vs FP8" "$W/pytest.log" | head -20
  pack
fi
if has kernels; then
  timeout "$(left 150)" python3 -m bench.kernels --sections moe_prefill --quick --json "$W/kernels.json" \
    > "$W/kernels.log" 2>&1
  log "kernels moe_prefill rc=$?"
  grep -E "^\||\[moe_prefill\]|Error" "$W/kernels.log" | tail -24
  pack
fi
if has engine || has engine120; then
  wait_ckpt
fi
if has engine; then
  mkdir -p "$W/eg8k" "$W/eg32k"
  timeout "$(left 100)" python3 bench/engine_gpu.py --preset 20b --ckpt /tmp/ckpt-eg --out "$W/eg8k" \
    --record "$W/eg8k/performance.md" --prefill-only --compare-moe-prefill --profile --check-tokens 256 \
    > "$W/eg8k.log" 2>&1
  log "engine_gpu 20b 8k rc=$?"
  grep -vE "^\s*$|Warning|warn" "$W/eg8k.log" | tail -40
  timeout "$(left 10)" python3 bench/engine_gpu.py --preset 20b --ckpt /tmp/ckpt-eg --out "$W/eg32k" \
    --prefill-only --compare-moe-prefill --prompt-len 32768 --check-tokens 64 > "$W/eg32k.log" 2>&1
  log "engine_gpu 20b 32k rc=$?"
  grep -E "^prefill|rel L2" "$W/eg32k.log"
  pack
fi
if has engine120; then
  mkdir -p "$W/eg120"
  timeout "$(left 10)" python3 bench/engine_gpu.py --preset 120b --layers "$LAYERS120" --ckpt /tmp/ckpt-eg \
    --out "$W/eg120" --prefill-only --compare-moe-prefill --profile --check-tokens 64 > "$W/eg120.log" 2>&1
  log "engine_gpu 120b ($LAYERS120 layers) rc=$?"
  grep -vE "^\s*$|Warning|warn" "$W/eg120.log" | tail -30
  pack
fi
save_caches
pack
ls -la "$OUT"
log end
