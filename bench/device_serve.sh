#!/bin/bash
# `pdserve serve --device cuda` on ONE GPU host without network: the router, one prefill and one
# decode worker as separate processes sharing GPU 0 (memory split by flags: the decode worker's
# --kv-blocks, the prefill worker's --prefix-cache-tokens), KV moving between them through NIXL in
# VRAM; then bench/serving.py over HTTP at a few request rates against it and against the same
# engine in one process (the baseline is loaded in the benchmark's process while the idle cluster
# still holds its memory). Random gpt-oss-20b-shaped weights. Run from the checkout root:
#
#     STEPS=prep  bash bench/device_serve.sh   # nixl wheels -> /tmp/site-nixl; starts writing the
#                                              # checkpoint in the background (it outlives the call)
#     STEPS=serve OUT=/tmp/out bash bench/device_serve.sh
#
# The wheels come from bench/offline_wheels.sh (download them where there is network):
# WHEELS_NIXL (default .whl/nixl) in the prep step, WHEELS_SERVE (default .whl/serve) in the serve
# step (any split of the wheels between the two folders works); the serve step also sources
# .gpu/setup.sh (FlashInfer). STEPS=prep,serve does both in one call.
#
# Dry run on a CPU machine with pdserve's dependencies installed (tiny built-in model, no wheels):
#     DEVICE=cpu PY=.venv/bin/python OUT=/tmp/out bash bench/device_serve.sh
#
# Knobs: RATES (comma list, req/s), NUM_REQUESTS (per rate), INPUT_LEN / OUTPUT_LEN (means; uniform
# +-50%), KV_BLOCKS (decode worker, 16-token blocks), MAX_BATCH, PREFIX_CACHE_TOKENS (prefill
# worker), CKPT_ROOT, BUDGET (seconds for the whole script). Results: $OUT/serving_h200.md (tables),
# $OUT/serving.json (every figure), $OUT/serve.tgz (all logs). Everything started here is stopped on
# exit, except the prep step's checkpoint writer, left to finish on purpose.
set -u
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-serve}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
BUDGET=${BUDGET:-560}
W=${W:-/tmp/wserve}
CKPT_ROOT=${CKPT_ROOT:-/tmp/ckpt}
WHEELS_NIXL=${WHEELS_NIXL:-.whl/nixl}
WHEELS_SERVE=${WHEELS_SERVE:-.whl/serve}
SITE_NIXL=/tmp/site-nixl
SITE_SERVE=/tmp/site-serve
if [ "$DEVICE" = cuda ]; then
  RATES=${RATES:-4,16,64}; NUM_REQUESTS=${NUM_REQUESTS:-48}; INPUT_LEN=${INPUT_LEN:-1024}; OUTPUT_LEN=${OUTPUT_LEN:-128}
  KV_BLOCKS=${KV_BLOCKS:-16384}; MAX_BATCH=${MAX_BATCH:-64}
else
  RATES=${RATES:-4,16}; NUM_REQUESTS=${NUM_REQUESTS:-6}; INPUT_LEN=${INPUT_LEN:-64}; OUTPUT_LEN=${OUTPUT_LEN:-8}
  KV_BLOCKS=${KV_BLOCKS:-512}; MAX_BATCH=${MAX_BATCH:-8}
fi
PREFIX_CACHE_TOKENS=${PREFIX_CACHE_TOKENS:-65536}
PORT=${PORT:-18000}
GRPC_PORT=${GRPC_PORT:-18051}
mkdir -p "$W/logs" "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[serve $(date +%T) +${SECONDS}s] $*"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
left() { local v=$(( BUDGET - SECONDS - ${1:-0} )); [ "$v" -lt 1 ] && v=1; echo "$v"; }
pack() { tar -czf "$OUT/serve.tgz" -C "$W" . 2>/dev/null; }
ckpt_dir() { echo "$CKPT_ROOT/20b-mxfp4-seed0"; }

serve_pid=""
bg_pids=()
cleanup() {  # everything this call started (the serve step's cluster, warm-ups, a checkpoint writer)
  if [ -n "$serve_pid" ] && kill -0 "$serve_pid" 2>/dev/null; then
    kill -TERM "$serve_pid" 2>/dev/null  # pdserve serve drains and stops its children
    for _ in $(seq 1 40); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$serve_pid" 2>/dev/null
  fi
  for p in "${bg_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  pack
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# the random 20b checkpoint (bench/model.py's, where bench/device_decode.sh and device_prefill.sh
# write it too); a writer already running, ours or theirs, is waited for, never doubled
write_ckpt="
from pathlib import Path
from pdserve.bench.model import ensure_checkpoint
print(*ensure_checkpoint('20b', Path('$CKPT_ROOT')))
"
writing_ckpt() { pgrep -f ensure_checkpoint > /dev/null; }
# the uninstalled checkout as `pdserve` (links on PYTHONPATH)
source bench/device_pkg.sh

if has prep; then
  if [ -d "$WHEELS_NIXL" ]; then
    (source bench/offline_wheels.sh install "$WHEELS_NIXL" --target "$SITE_NIXL" > /dev/null \
       && $PY -c "import nixl_cu13._api; print('nixl_cu13 loads')") || { log "nixl wheels: install failed"; exit 1; }
  fi
  if [ "$DEVICE" = cuda ] && [ ! -f "$(ckpt_dir)/config.json" ] && ! writing_ckpt; then
    # detached (its own session): it goes on writing after this call returns; the serve step waits for it
    setsid nohup $PY -c "$write_ckpt" > /tmp/ckpt20.log 2>&1 < /dev/null &
    log "writing the random 20b checkpoint in the background (/tmp/ckpt20.log)"
  fi
fi
has serve || exit 0

if [ "$DEVICE" = cuda ]; then
  source .gpu/setup.sh || exit 1
  [ -d "$SITE_NIXL" ] || { log "no $SITE_NIXL: run STEPS=prep first (or STEPS=prep,serve)"; exit 1; }
  source bench/offline_wheels.sh install "$WHEELS_SERVE" --target "$SITE_SERVE" > /dev/null \
    || { log "serve wheels: install failed"; exit 1; }
  export PYTHONPATH=$SITE_NIXL:$PYTHONPATH  # after the serve wheels: the nixl meta package is among them
  source bench/device_caches.sh
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$W/env.log"
  # FlashInfer's XQA decode modules are not prebuilt: built here while the checkpoint is written,
  # not by the decode worker and the baseline at once
  for t in xqa-full xqa-window; do
    timeout 300 $PY -m pdserve.bench.kernels --warm-jit $t > "$W/logs/warm_$t.log" 2>&1 &
    bg_pids+=($!)
  done
  if [ ! -f "$(ckpt_dir)/config.json" ]; then
    if writing_ckpt; then  # the prep step's (or another script's), not our child
      log "waiting for the checkpoint writer already running"
      while writing_ckpt && [ ! -f "$(ckpt_dir)/config.json" ] && [ "$SECONDS" -lt $(( BUDGET - 300 )) ]; do sleep 2; done
    else
      log "writing the random 20b checkpoint"
      timeout "$(left 300)" $PY -c "$write_ckpt" > /tmp/ckpt20.log 2>&1
    fi
  fi
  cp /tmp/ckpt20.log "$W/logs/" 2>/dev/null
  [ -f "$(ckpt_dir)/config.json" ] || { log "no checkpoint at $(ckpt_dir)"; tail -5 /tmp/ckpt20.log; exit 1; }
  log "checkpoint ready: $(du -sh "$(ckpt_dir)" | cut -f1)"
  for p in "${bg_pids[@]}"; do wait "$p"; done
  bg_pids=()
  grep -h "ready in\|Error" "$W"/logs/warm_*.log | tail -4
  MODEL=$(ckpt_dir)
  $PY -c "import fastapi, uvicorn, openai_harmony, llguidance, grpc, google.protobuf, nixl._api; print('imports ok: grpcio', grpc.__version__, 'protobuf', google.protobuf.__version__)" || exit 1
else
  MODEL=tiny
fi

# -- the cluster: router + prefill + decode, both workers on GPU 0 -----------------------------------
serve_args=(--model "$MODEL" --device "$DEVICE" --port "$PORT" --grpc-port "$GRPC_PORT" --prefill-workers 1
            --decode-workers 1 --kv-blocks "$KV_BLOCKS" --max-batch-size "$MAX_BATCH"
            --prefix-cache-tokens "$PREFIX_CACHE_TOKENS" --log-dir "$W/logs" --max-restarts 0)
echo "pdserve serve ${serve_args[*]}" > "$W/serve_command.txt"
log "starting: pdserve serve ${serve_args[*]}"
$PY -m pdserve.launch.cli serve "${serve_args[@]}" > "$W/logs/serve.log" 2>&1 &
serve_pid=$!
t0=$SECONDS
until $PY -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2).status != 200)" 2>/dev/null; do
  if ! kill -0 "$serve_pid" 2>/dev/null; then
    log "pdserve serve exited during start-up"; tail -30 "$W/logs/serve.log"
    for f in "$W"/logs/prefill-0.log "$W"/logs/decode-0.log; do echo "== $f"; tail -15 "$f"; done
    exit 1
  fi
  [ "$SECONDS" -ge $(( BUDGET - 150 )) ] && { log "not healthy in time"; tail -20 "$W"/logs/*.log; exit 1; }
  sleep 2
done
log "serving after $(( SECONDS - t0 )) s"
grep -h "serving\|KV blocks" "$W"/logs/*.log | head -5
[ "$DEVICE" = cuda ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$W/env.log"

# one chat completion over HTTP, as a user would send it
$PY - "$PORT" > "$W/chat.json" 2>&1 <<'EOF'
import json, sys, time, urllib.request
body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Explain NIXL in one line."}], "max_tokens": 32}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
t = time.perf_counter()
reply = json.load(urllib.request.urlopen(req, timeout=120))
print(json.dumps({"seconds": round(time.perf_counter() - t, 3), "usage": reply["usage"],
                  "finish_reason": reply["choices"][0]["finish_reason"]}))
EOF
log "chat completion: $(tail -1 "$W/chat.json")"

# -- the benchmark: the cluster at each rate, then the single-process engine at each rate ------------
where="on CPU"
[ "$DEVICE" = cuda ] && where="sharing GPU 0"
bench_args=(--url "http://127.0.0.1:$PORT" --model "$MODEL" --device "$DEVICE" --rates "$RATES"
            --num-requests "$NUM_REQUESTS" --input-len "$INPUT_LEN" --input-dist uniform --input-spread 0.5
            --output-len "$OUTPUT_LEN" --output-dist uniform --output-spread 0.5 --max-batch-size "$MAX_BATCH"
            --warmup 4 --label "$(basename "$MODEL"), 1 prefill + 1 decode worker $where, completions, $NUM_REQUESTS requests"
            --json "$OUT/serving.json")
log "bench: python -m pdserve.bench.serving ${bench_args[*]}"
timeout "$(left 30)" $PY -m pdserve.bench.serving "${bench_args[@]}" > "$W/bench.log" 2> "$W/logs/bench.err"
rc=$?
log "bench rc=$rc"
[ "$rc" = 0 ] || tail -20 "$W/logs/bench.err"
{
  echo "Commands: \`$(cat "$W/serve_command.txt")\`, then \`python -m pdserve.bench.serving ${bench_args[*]}\`"
  echo
  cat "$W/bench.log"
} > "$OUT/serving_h200.md"
cat "$W/bench.log"
[ "$DEVICE" = cuda ] && save_caches  # FlashInfer XQA modules and Triton kernels built here, for a next run
log end
