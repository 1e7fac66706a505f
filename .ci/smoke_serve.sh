#!/usr/bin/env bash
# The README's first command as a new user meets it: the installed `pdserve serve` (tiny built-in
# model, CPU), started from another directory with no PYTHONPATH, answers one chat completion over
# curl, stops on SIGTERM, and leaves no process behind.
#   usage: .ci/smoke_serve.sh [PDSERVE]     (default: this checkout's .venv/bin/pdserve)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
pdserve="${1:-$repo/.venv/bin/pdserve}"
work="$(mktemp -d)"
cd "$work"                      # not the checkout: nothing may come from the working directory
unset PYTHONPATH

py="$(dirname "$pdserve")/python"
# two ports held open together, so they differ (two separate binds can hand out the same one)
read -r http_port grpc_port < <("$py" -c 'import socket; s = [socket.socket() for _ in "ab"]
[x.bind(("127.0.0.1", 0)) for x in s]; print(*(x.getsockname()[1] for x in s))')

descendants() {  # every live process below $1, grandchildren included (from /proc: no procps needed)
    "$py" - "$1" <<'PY'
import os, sys
parent = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if stat[0] != "Z":
        parent[int(pid)] = int(stat[1])
todo, found = [int(sys.argv[1])], []
while todo:
    p = todo.pop()
    kids = [c for c, pp in parent.items() if pp == p]
    found += kids
    todo += kids
print(" ".join(map(str, found)))
PY
}
fail() {
    echo "smoke_serve: FAIL: $*" >&2
    echo "--- pdserve serve output:" >&2; cat "$work/serve.out" >&2 || true
    for f in "$work"/logs/*.log; do echo "--- $f (tail):" >&2; tail -n 30 "$f" >&2; done
    kill -KILL "$serve_pid" ${tree:-} 2>/dev/null || true
    exit 1
}

"$pdserve" serve --port "$http_port" --grpc-port "$grpc_port" --log-dir "$work/logs" >"$work/serve.out" 2>&1 &
serve_pid=$!
for _ in $(seq 1 900); do         # start-up: at most 90 s (the first run also writes the tiny model)
    grep -q "serving gpt-oss at" "$work/serve.out" && break
    kill -0 "$serve_pid" 2>/dev/null || fail "pdserve serve exited during start-up"
    sleep 0.1
done
grep -q "serving gpt-oss at http://127.0.0.1:$http_port/v1" "$work/serve.out" || fail "not serving after 90 s"
tree="$(descendants "$serve_pid")"
[ -n "$tree" ] || fail "pdserve serve started no processes"

reply="$(curl -sS --max-time 60 "http://127.0.0.1:$http_port/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d '{"model": "gpt-oss", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}')" \
    || fail "curl failed"
echo "$reply" | "$py" -c '
import json, sys
r = json.load(sys.stdin)
assert r["object"] == "chat.completion", r
assert r["choices"][0]["finish_reason"] in ("stop", "length"), r
assert r["usage"]["completion_tokens"] > 0, r
' || fail "unexpected reply: $reply"

kill -TERM "$serve_pid"
for _ in $(seq 1 300); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$serve_pid" 2>/dev/null && fail "pdserve serve still running 30 s after SIGTERM"
wait "$serve_pid" || fail "pdserve serve exited with code $? after SIGTERM"
left=""
for p in $tree; do   # still there and not a zombie
    if [ -r "/proc/$p/stat" ] && [ "$(cut -d')' -f2 "/proc/$p/stat" 2>/dev/null | cut -d' ' -f2)" != "Z" ]; then
        left="$left $p"
    fi
done
[ -z "$left" ] || { for p in $left; do tr '\0' ' ' <"/proc/$p/cmdline" >&2; echo >&2; done; fail "processes left running:$left"; }
rm -rf "$work"
echo "smoke_serve: ok (started, answered a chat completion, stopped on SIGTERM, no process left)"
