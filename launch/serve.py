"""Serve a local cluster: router + prefill and decode workers as separate processes.

With no arguments it serves a built-in tiny random model on CPU (the README's first command).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pdserve.serve")


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def builtin_tiny_model() -> Path:
    """The embedded default: a tiny random gpt-oss checkpoint (full vocabulary), made once."""
    path = cache_dir() / "models" / "tiny-seed0"
    if (path / "config.json").is_file():
        return path
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent))
    make_random_checkpoint(tmp / "ckpt", preset("tiny"), seed=0)
    try:
        os.replace(tmp / "ckpt", path)
    except OSError:  # another process made it first
        pass
    return path


@dataclass
class ClusterSpec:
    model: str = "tiny"
    served_model_name: str = "gpt-oss"
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    prefill_workers: int = 1
    decode_workers: int = 1
    device: str = "cpu"
    prefill_tp: int = 1
    decode_tp: int = 1
    decode_ep: int | None = None  # None: = decode_tp (EP4 TP4 on 4 GPUs)
    max_batch_size: int = 64
    kv_blocks: int | None = None
    extra_router_args: list[str] = field(default_factory=list)
    extra_worker_args: list[str] = field(default_factory=list)
    extra_prefill_args: list[str] = field(default_factory=list)  # e.g. --prefix-cache-tokens 0


class LocalCluster:
    """Starts, watches and stops the processes of one local deployment."""

    def __init__(self, spec: ClusterSpec, log_dir: str | Path | None = None):
        self.spec = spec
        self.tmp = Path(tempfile.mkdtemp(prefix="pdserve-"))
        self.log_dir = Path(log_dir) if log_dir else self.tmp
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}
        self.model = str(builtin_tiny_model()) if spec.model == "tiny" else spec.model
        self._gpus: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def gpu_plan(self) -> dict[str, str]:
        """Worker name -> CUDA_VISIBLE_DEVICES on a CUDA cluster: disjoint GPUs for every rank
        when there are enough (a worker of N ranks uses its first N visible devices); one-rank
        workers share GPUs round-robin otherwise. Empty on CPU."""
        s = self.spec
        if s.device != "cuda":
            return {}
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is not None:
            visible = [d for d in env.split(",") if d.strip()]
        else:
            import torch

            visible = [str(i) for i in range(torch.cuda.device_count())]
        workers = [(f"prefill-{i}", s.prefill_tp) for i in range(s.prefill_workers)]
        workers += [(f"decode-{i}", s.decode_tp) for i in range(s.decode_workers)]
        need = sum(n for _, n in workers)
        if not visible or (need > len(visible) and max(n for _, n in workers) > 1):
            raise ValueError(f"the cluster needs {need} GPUs ({s.prefill_workers} prefill x TP {s.prefill_tp}, "
                             f"{s.decode_workers} decode x TP {s.decode_tp}) but {len(visible)} are visible")
        plan, nxt = {}, 0
        for name, n in workers:
            plan[name] = ",".join(visible[(nxt + k) % len(visible)] for k in range(n))
            nxt += n
        return plan

    def _spawn(self, name: str, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        if self.spec.device == "cpu":  # DRAM over TCP; on GPU hosts UCX's default includes cuda
            env.setdefault("UCX_TLS", "tcp,self,sm")
            # the processes share the cores: one torch thread each per core share, not per core
            s = self.spec
            procs = 1 + s.prefill_workers * s.prefill_tp + s.decode_workers * s.decode_tp
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
        p = subprocess.Popen([sys.executable, "-m", "pdserve.launch.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def start_worker(self, role: str, index: int) -> str:
        s = self.spec
        name = f"{role}-{index}"
        ready = self.tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        args = [f"{role}-worker", "--model", self.model, "--host", s.host, "--port", "0", "--device", s.device,
                "--ready-file", str(ready), "--worker-id", name, *s.extra_worker_args]
        if role == "prefill":
            args += ["--tp", str(s.prefill_tp), *s.extra_prefill_args]
        else:
            args += ["--tp", str(s.decode_tp), "--ep", str(s.decode_ep or s.decode_tp),
                     "--max-batch-size", str(s.max_batch_size)]
            if s.kv_blocks:
                args += ["--kv-blocks", str(s.kv_blocks)]
        gpus = self._gpus.get(name)
        self._spawn(name, args, {"CUDA_VISIBLE_DEVICES": gpus} if gpus else None)
        return name

    def _wait_ready(self, names: list[str], timeout: float) -> None:
        end = time.monotonic() + timeout
        pending = set(names)
        while pending:
            for name in list(pending):
                f = self.tmp / f"{name}.ready"
                if f.is_file():
                    self.addresses[name] = json.loads(f.read_text())["address"]
                    pending.discard(name)
                elif self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited with code {self.procs[name].returncode}; see {self.log_dir / (name + '.log')}:\n"
                                       + self.tail(name))
            if time.monotonic() > end:
                raise TimeoutError(f"workers not ready after {timeout:.0f}s: {sorted(pending)}")
            time.sleep(0.1)

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self, timeout: float = 180.0) -> "LocalCluster":
        s = self.spec
        self._gpus = self.gpu_plan()
        names = [self.start_worker("prefill", i) for i in range(s.prefill_workers)]
        names += [self.start_worker("decode", i) for i in range(s.decode_workers)]
        try:
            self._wait_ready(names, timeout)
            prefill = ",".join(self.addresses[n] for n in names if n.startswith("prefill"))
            decode = ",".join(self.addresses[n] for n in names if n.startswith("decode"))
            self._spawn("router", ["router", "--host", s.host, "--port", str(s.port), "--grpc-port", str(s.grpc_port),
                                   "--served-model-name", s.served_model_name, "--discovery", "static",
                                   "--prefill", prefill, "--decode", decode, *s.extra_router_args])
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.procs["router"].poll() is not None:
                raise RuntimeError("router exited:\n" + self.tail("router"))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not healthy after {timeout:.0f}s:\n" + self.tail("router"))

    def kill(self, name: str) -> None:
        """Kill one process without warning (fault-injection in tests)."""
        p = self.procs[name]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def stop(self, grace: float = 15.0) -> None:
        order = ["router"] + [n for n in self.procs if n != "router"]
        for name in order:
            p = self.procs.get(name)
            if p and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        for name in order:
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="checkpoint directory, or `tiny` (built-in random model)")
    p.add_argument("--served-model-name", default="gpt-oss")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    p.add_argument("--grpc-port", type=int, default=50051, help="port of the token-level gRPC API")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--decode-ep", type=int, default=None,
                   help="expert-parallel groups of a decode worker, dividing --decode-tp (default: --decode-tp)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a temp dir)")


def run(a: argparse.Namespace) -> int:
    if a.decode_ep is None:
        a.decode_ep = a.decode_tp
    for flag in ("prefill_workers", "decode_workers", "prefill_tp", "decode_tp", "decode_ep", "max_batch_size"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if a.decode_tp % a.decode_ep:
        raise ValueError(f"--decode-ep {a.decode_ep} must divide --decode-tp {a.decode_tp}")
    spec = ClusterSpec(model=a.model, served_model_name=a.served_model_name, host=a.host, port=a.port,
                       grpc_port=a.grpc_port, prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                       device=a.device, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, decode_ep=a.decode_ep,
                       max_batch_size=a.max_batch_size)
    cluster = LocalCluster(spec, a.log_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"pdserve: starting {spec.prefill_workers} prefill + {spec.decode_workers} decode workers "
          f"({cluster.model}); logs in {cluster.log_dir}", flush=True)
    cluster.start()
    print(f"pdserve: serving {spec.served_model_name} at {cluster.url}/v1 (gRPC {spec.host}:{spec.grpc_port})"
          " - Ctrl-C to stop", flush=True)
    reported: set[str] = set()
    try:
        while not stop.is_set():
            dead = {n for n, p in cluster.procs.items() if p.poll() is not None}
            for n in dead - reported:
                print(f"pdserve: {n} exited (code {cluster.procs[n].returncode}); the router routes around it",
                      file=sys.stderr, flush=True)
            reported |= dead
            roles_alive = {n.split("-")[0] for n in cluster.procs if n not in dead}
            if not {"router", "prefill", "decode"} <= roles_alive:
                print("pdserve: no router, prefill or decode worker left; stopping", file=sys.stderr, flush=True)
                break
            stop.wait(0.5)
    finally:
        cluster.stop()
        print("pdserve: stopped", flush=True)
    return 0
