"""`pdserve serve` as a user runs it (the CLI in its own process): a worker killed under load is
restarted and serves again; `pdserve serve` killed with SIGKILL takes every process with it."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from processes import alive, children, cmdline, descendants
from ports import free_ports

pytestmark = pytest.mark.slow


class Serve:
    """`pdserve serve` in a child process; its output lines collected by a thread."""

    def __init__(self, model: str, log_dir: str, *extra: str):
        self.port, grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.launch.cli", "serve", "--model", model, "--port", str(self.port),
             "--grpc-port", str(grpc_port), "--log-dir", log_dir, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for_line(self, text: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines)
            assert time.monotonic() < end, f"no {text!r} after {timeout:.0f} s:\n" + "\n".join(self.lines)
            time.sleep(0.1)

    def worker_pid(self, role: str) -> int:
        pids = [p for p in children(self.proc.pid) if f"{role}-worker" in cmdline(p)]
        assert len(pids) == 1, pids
        return pids[0]

    def close(self) -> None:
        tree = descendants(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        for p in tree:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.fixture(scope="module")
def serve(tiny_mxfp4, tmp_path_factory):
    s = Serve(str(tiny_mxfp4), str(tmp_path_factory.mktemp("serve-logs")), "--restart-backoff", "0.5")
    try:
        s.wait_for_line("serving gpt-oss at", timeout=120)
        yield s
    finally:
        s.close()


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < end, [(p, cmdline(p)) for p in pids if alive(p)]
        time.sleep(0.1)


def chat(url: str, max_tokens: int = 8) -> dict:
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


async def _stream(h: httpx.AsyncClient, url: str, seed: int) -> str:
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 4000, "seed": seed, "stream": True}
    events = []
    async with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "error" if any('"error"' in e for e in events) else "done"
            if line.startswith("data: "):
                events.append(line)
    return "cut"


def test_killed_decode_worker_streams_end_cleanly_and_it_serves_again(serve):
    old = serve.worker_pid("decode")

    killed_at = []

    async def under_load() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as h:
            tasks = [asyncio.create_task(_stream(h, serve.url, i)) for i in range(4)]
            await asyncio.sleep(2.0)  # the streams are running
            os.kill(old, signal.SIGKILL)
            killed_at.append(time.monotonic())
            return await asyncio.gather(*tasks)

    results = asyncio.run(under_load())
    # each stream ends cleanly: an error event, or finished after the router moved it on (to the
    # restarted worker, --max-migrations); never cut off or hanging
    assert set(results) <= {"error", "done"}, results

    serves_again(serve, "decode", old, killed_at[0])


def test_killed_prefill_worker_serves_again(serve):
    old = serve.worker_pid("prefill")
    os.kill(old, signal.SIGKILL)
    serves_again(serve, "prefill", old, time.monotonic())


def serves_again(serve: Serve, role: str, old_pid: int, killed_at: float) -> None:
    """A chat completion succeeds within 30 s of the kill, on a new process; later ones too."""
    while True:
        try:
            reply = chat(serve.url)
            break
        except (AssertionError, httpx.HTTPError):
            assert time.monotonic() < killed_at + 30.0, "\n".join(serve.lines)
            time.sleep(0.5)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert serve.worker_pid(role) != old_pid
    serve.wait_for_line(f"{role}-0 is serving again", timeout=10)
    for _ in range(3):
        assert chat(serve.url)["usage"]["completion_tokens"] > 0


def test_sigkill_of_serve_leaves_no_process(serve):
    tree = descendants(serve.proc.pid)
    assert len(tree) >= 3, tree  # router, prefill and decode workers
    serve.proc.kill()
    serve.proc.wait()
    assert_gone(tree)


def test_ctrl_c_during_start_up_stops_everything(tiny_mxfp4, tmp_path):
    s = Serve(str(tiny_mxfp4), str(tmp_path))
    try:
        s.wait_for_line("pdserve: starting", timeout=60)
        end = time.monotonic() + 30
        while len(descendants(s.proc.pid)) < 2:  # the workers are starting
            assert time.monotonic() < end
            time.sleep(0.05)
        tree = descendants(s.proc.pid)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=30) == 130
        assert not any("serving gpt-oss" in line for line in s.lines), s.lines
        assert_gone(tree)
    finally:
        s.close()


def test_a_second_ctrl_c_stops_at_once(tiny_mxfp4, tmp_path):
    """The first Ctrl-C drains (streams may finish); the second ends the drain: a stream that
    would run for minutes is cut, serve exits at once and leaves no process."""
    s = Serve(str(tiny_mxfp4), str(tmp_path))
    try:
        s.wait_for_line("serving gpt-oss at", timeout=120)
        tree = descendants(s.proc.pid)
        body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert r.status_code == 200 and next(line for line in lines if line.startswith("data: "))
            s.proc.send_signal(signal.SIGINT)
            s.wait_for_line("Ctrl-C again", timeout=10)
            s.proc.send_signal(signal.SIGINT)
            assert s.proc.wait(timeout=10) == 0
            try:
                rest = list(lines)
            except httpx.HTTPError:  # the connection was cut
                rest = []
            assert not any('"finish_reason":"length"' in line for line in rest)
        assert_gone(tree)
    finally:
        s.close()


# -- the restart policy on its own (a fake cluster and clock) ----------------------------------
class FakeProc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeCluster:
    def __init__(self, names):
        self.procs = {n: FakeProc() for n in names}
        self.restarts: list[str] = []
        self.log_dir = Path("logs")

    def restart(self, name):
        self.restarts.append(name)
        self.procs[name] = FakeProc()

    def ready_address(self, name):
        return "127.0.0.1:1"


def test_supervisor_restarts_with_doubling_backoff_and_gives_up_after_the_limit():
    from pdserve.launch.serve import RestartPolicy, Supervisor

    now = [0.0]
    cluster = FakeCluster(["prefill-0", "decode-0", "router"])
    out = io.StringIO()
    sup = Supervisor(cluster, RestartPolicy(max_restarts=3, backoff_s=1.0, max_backoff_s=3.0, stable_s=60.0),
                     out=out, clock=lambda: now[0])
    assert sup.poll() and not cluster.restarts
    delays = []
    for _ in range(3):  # dies at once each time: 1 s, 2 s, then capped at 3 s
        cluster.procs["decode-0"].returncode = -9
        assert sup.poll()
        start = now[0]
        while not cluster.restarts or len(cluster.restarts) == len(delays):
            now[0] += 0.25
            assert sup.poll()
        delays.append(now[0] - start)
    assert delays == [1.0, 2.0, 3.0]
    cluster.procs["decode-0"].returncode = 1  # the 4th exit in a row: no decode worker left
    assert not sup.poll()
    now[0] += 100
    assert not sup.poll() and len(cluster.restarts) == 3
    assert "not restarting it" in out.getvalue()


def test_supervisor_forgives_a_process_that_ran_long_enough():
    from pdserve.launch.serve import RestartPolicy, Supervisor

    now = [0.0]
    cluster = FakeCluster(["prefill-0", "decode-0", "router"])
    sup = Supervisor(cluster, RestartPolicy(max_restarts=1, backoff_s=1.0, stable_s=60.0), out=io.StringIO(),
                     clock=lambda: now[0])
    for _ in range(3):  # each restart runs a minute before it dies: never "in a row"
        cluster.procs["router"].returncode = 1
        assert sup.poll()
        now[0] += 1.0
        assert sup.poll()
        now[0] += 61.0
        assert sup.poll()
    assert cluster.restarts == ["router"] * 3
