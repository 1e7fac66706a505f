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

from pdserve.launch.child import PARENT_PID_ENV
from pdserve.router.main import add_serving_args, serving_argv

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
    kv_memory_fraction: float | None = None  # decode workers without kv_blocks (None: the worker's default)
    extra_router_args: list[str] = field(default_factory=list)
    extra_worker_args: list[str] = field(default_factory=list)
    extra_prefill_args: list[str] = field(default_factory=list)  # e.g. --prefix-cache-tokens 0
    extra_decode_args: list[str] = field(default_factory=list)  # e.g. --reservation-ttl 30


class StartInterrupted(Exception):
    """`LocalCluster.start` was cancelled (Ctrl-C or SIGTERM during start-up)."""


class LocalCluster:
    """Starts, watches and stops the processes of one local deployment.

    Every process dies with the thread that started it (see launch/child.py): start, restart and
    stop it from a thread that lives as long as the cluster. Setting `cancel` makes a `start` in
    progress stop what it started and raise StartInterrupted.
    """

    def __init__(self, spec: ClusterSpec, log_dir: str | Path | None = None,
                 cancel: threading.Event | None = None):
        self.spec = spec
        self.cancel = cancel
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

    def start_waves(self) -> list[list[tuple[str, int]]]:
        """The workers as (role, index), in groups started together, each group once the one before
        is ready. All in one group, unless decode workers size their KV caches from free GPU memory
        (no kv_blocks) on GPUs that other workers use: then the prefill workers load first and each
        decode worker after those sharing its GPUs, so that the free memory it measures is what
        the others left."""
        s = self.spec
        prefill = [("prefill", i) for i in range(s.prefill_workers)]
        decode = [("decode", i) for i in range(s.decode_workers)]
        if not self._gpus or s.kv_blocks:
            return [prefill + decode]

        def gpus(role: str, i: int) -> set[str]:
            return set(self._gpus[f"{role}-{i}"].split(","))

        prefill_gpus = set().union(*(gpus(*w) for w in prefill))
        waves: list[tuple[set[str], list[tuple[str, int]]]] = []  # decode workers on disjoint GPUs
        for w in decode:
            for used, wave in waves:
                if not used & gpus(*w):
                    used |= gpus(*w)
                    wave.append(w)
                    break
            else:
                waves.append((gpus(*w), [w]))
        if len(waves) == 1 and not waves[0][0] & prefill_gpus:
            return [prefill + decode]
        return [prefill] + [wave for _, wave in waves]

    def _spawn(self, name: str, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **(extra_env or {})}
        if self.spec.device == "cpu":  # DRAM over TCP; on GPU hosts UCX's default includes cuda
            env.setdefault("UCX_TLS", "tcp,self,sm")
            # the processes share the cores: one torch thread each per core share, not per core
            s = self.spec
            procs = 1 + s.prefill_workers * s.prefill_tp + s.decode_workers * s.decode_tp
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
        try:
            p = subprocess.Popen([sys.executable, "-m", "pdserve.launch.child", *args], stdout=out,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            out.close()  # the child holds its own descriptor
        self.procs[name] = p
        return p

    def start_worker(self, role: str, index: int, port: int = 0) -> str:
        s = self.spec
        name = f"{role}-{index}"
        ready = self.tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        args = [f"{role}-worker", "--model", self.model, "--host", s.host, "--port", str(port), "--device", s.device,
                "--ready-file", str(ready), "--worker-id", name, *s.extra_worker_args]
        if role == "prefill":
            args += ["--tp", str(s.prefill_tp), *s.extra_prefill_args]
        else:
            args += ["--tp", str(s.decode_tp), "--ep", str(s.decode_ep or s.decode_tp),
                     "--max-batch-size", str(s.max_batch_size)]
            if s.kv_blocks:
                args += ["--kv-blocks", str(s.kv_blocks)]
            elif s.kv_memory_fraction is not None:
                args += ["--kv-memory-fraction", str(s.kv_memory_fraction)]
            args += s.extra_decode_args
        gpus = self._gpus.get(name)
        self._spawn(name, args, {"CUDA_VISIBLE_DEVICES": gpus} if gpus else None)
        return name

    def ready_address(self, name: str) -> str | None:
        """The address worker `name` wrote once serving (None until then)."""
        f = self.tmp / f"{name}.ready"
        return json.loads(f.read_text())["address"] if f.is_file() else None

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise StartInterrupted("start-up interrupted")

    def _wait_ready(self, names: list[str], timeout: float) -> None:
        end = time.monotonic() + timeout
        pending = set(names)
        while pending:
            self._check_cancel()
            for name in list(pending):
                address = self.ready_address(name)
                if address is not None:
                    self.addresses[name] = address
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
        self._check_cancel()  # interrupted while the built-in model was being made
        self._gpus = self.gpu_plan()
        try:
            for wave in self.start_waves():
                self._wait_ready([self.start_worker(role, i) for role, i in wave], timeout)
            self.start_router()
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_router(self) -> str:
        """The router, on the workers' addresses (static discovery: a restarted worker keeps its own)."""
        s = self.spec
        prefill = ",".join(a for n, a in self.addresses.items() if n.startswith("prefill"))
        decode = ",".join(a for n, a in self.addresses.items() if n.startswith("decode"))
        self._spawn("router", ["router", "--host", s.host, "--port", str(s.port), "--grpc-port", str(s.grpc_port),
                               "--served-model-name", s.served_model_name, "--discovery", "static",
                               "--prefill", prefill, "--decode", decode,
                               # a worker restarted here is probed back within 2 s (probes are cheap)
                               "--breaker-reset-timeout", "1", "--breaker-max-reset-timeout", "2",
                               *s.extra_router_args])
        return "router"

    def restart(self, name: str) -> None:
        """Start the exited process `name` again, on the address it had."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        if name == "router":
            self.start_router()
            return
        role, index = name.rsplit("-", 1)
        self.start_worker(role, int(index), port=int(self.addresses[name].rsplit(":", 1)[1]))

    def wait_healthy(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._check_cancel()
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

    def stop(self, grace: float = 15.0, now: threading.Event | None = None) -> None:
        """SIGTERM every process (the router and the workers drain together); SIGKILL what is left
        after `grace` seconds, or as soon as `now` is set (a second Ctrl-C)."""
        order = ["router"] + [n for n in self.procs if n != "router"]
        for name in order:
            self._signal(name, signal.SIGTERM)
        end = time.monotonic() + grace
        for name in order:
            p = self.procs.get(name)
            while p is not None and p.poll() is None and time.monotonic() < end and not (now and now.is_set()):
                try:
                    p.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
            if p is not None and p.poll() is None:
                self._signal(name, signal.SIGKILL)
                p.wait()

    def _signal(self, name: str, sig: int) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class RestartPolicy:
    """How `Supervisor` restarts an exited process: after `backoff_s`, doubled for each restart in
    a row (capped at `max_backoff_s`), at most `max_restarts` in a row (0: never). A process that
    ran `stable_s` seconds has its count reset."""

    max_restarts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"--restart-backoff must be in (0, {self.max_backoff_s}], got {self.backoff_s}")


@dataclass
class _Life:
    started_at: float
    in_a_row: int = 0
    restart_at: float | None = None  # exited: when it starts again
    given_up: bool = False
    announced: bool = True  # "serving again" printed (workers write a ready file)


class Supervisor:
    """Keeps a LocalCluster's processes running: one that exits is started again on its address
    (the router's static discovery probes it there and routes to it once it answers healthy).

    `poll()` does one pass and says whether the cluster can still serve; call it from the thread
    that started the cluster (children die with it).
    """

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy, out=sys.stderr,
                 clock=time.monotonic):
        self.cluster = cluster
        self.policy = policy
        self.out = out
        self.clock = clock
        now = clock()
        self.lives = {name: _Life(now) for name in cluster.procs}

    def _say(self, text: str) -> None:
        print(f"pdserve: {text}", file=self.out, flush=True)

    def poll(self) -> bool:
        now, p = self.clock(), self.policy
        for name, proc in self.cluster.procs.items():
            life = self.lives.setdefault(name, _Life(now))
            if life.given_up:
                continue
            if life.restart_at is not None:
                if now >= life.restart_at:
                    life.restart_at, life.started_at, life.announced = None, now, name == "router"
                    self.cluster.restart(name)
                continue
            if proc.poll() is None:
                if not life.announced and self.cluster.ready_address(name) is not None:
                    life.announced = True
                    self._say(f"{name} is serving again")
                if now - life.started_at >= p.stable_s:
                    life.in_a_row = 0
                continue
            if life.in_a_row >= p.max_restarts:
                life.given_up = True
                self._say(f"{name} exited (code {proc.returncode}); not restarting it "
                          f"({p.max_restarts} restarts in a row); see {self.cluster.log_dir / (name + '.log')}")
                continue
            delay = min(p.backoff_s * 2 ** life.in_a_row, p.max_backoff_s)
            life.in_a_row += 1
            life.restart_at = now + delay
            self._say(f"{name} exited (code {proc.returncode}); restarting it in {delay:.0f} s "
                      f"({life.in_a_row}/{p.max_restarts})")
        left = {n.split("-")[0] for n, life in self.lives.items() if not life.given_up}
        return {"router", "prefill", "decode"} <= left


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    from pdserve.launch.cli import add_prefill_chunk_arg, add_projection_precision_args

    p.add_argument("--model", default="tiny", help="checkpoint directory, or `tiny` (built-in random model)")
    p.add_argument("--served-model-name", default="gpt-oss", help="the model name clients send")
    p.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    p.add_argument("--grpc-port", type=int, default=50051, help="port of the token-level gRPC API")
    p.add_argument("--prefill-workers", type=int, default=1, help="prefill worker processes")
    p.add_argument("--decode-workers", type=int, default=1, help="decode worker processes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    add_projection_precision_args(p)
    p.add_argument("--prefill-tp", type=int, default=1, help="GPUs (tensor-parallel ranks) per prefill worker")
    p.add_argument("--decode-tp", type=int, default=1, help="GPUs (tensor-parallel ranks) per decode worker")
    p.add_argument("--decode-ep", type=int, default=None,
                   help="expert-parallel groups of a decode worker, dividing --decode-tp (none: --decode-tp)")
    p.add_argument("--decode-precision", default=None, choices=["bf16", "fp8", "mxfp4"],
                   help="expert weights of the decode workers (none: bf16 on CPU, fp8 on CUDA); mxfp4 keeps "
                        "them as published (--decode-tp 1): the fastest single-stream decode on an H200, "
                        "slower than fp8 from a few concurrent requests")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="requests each decode worker decodes together; more wait for a slot")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks per decode worker, each a 16-token page of the full-attention or of the "
                        "sliding-window layers (none: sized from free memory)")
    p.add_argument("--kv-memory-fraction", type=_fraction, default=None,
                   help="without --kv-blocks: share of the free GPU memory each decode worker gives to KV "
                        "blocks (none: the decode worker's default). Workers sharing a GPU start prefill "
                        "first, so a decode worker measures what the prefill workers left")
    p.add_argument("--reservation-ttl", type=float, default=60.0,
                   help="seconds a decode worker keeps KV blocks reserved for a request whose "
                        "router set no deadline")
    add_serving_args(p)
    p.add_argument("--prefix-cache-tokens", type=int, default=65536,
                   help="KV room of each prefill worker for cached prompt prefixes (0 = no prefix cache)")
    add_prefill_chunk_arg(p)
    p.add_argument("--log-dir", default=None, help="where process logs go (none: a temp dir)")
    p.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                   help="restarts of an exited process in a row before serve gives up on it (0 = never "
                        "restart; the count resets once it has run %d s)" % RestartPolicy.stable_s)
    p.add_argument("--restart-backoff", type=float, default=RestartPolicy.backoff_s,
                   help="seconds before the first restart, doubled for each one in a row up to %d s"
                        % RestartPolicy.max_backoff_s)


def run(a: argparse.Namespace) -> int:
    from pdserve.launch.cli import projection_precision_argv

    if a.decode_ep is None:
        a.decode_ep = a.decode_tp
    for flag in ("prefill_workers", "decode_workers", "prefill_tp", "decode_tp", "decode_ep", "max_batch_size"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("prefix_cache_tokens", "max_migrations"):
        if getattr(a, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
    if a.decode_tp % a.decode_ep:
        raise ValueError(f"--decode-ep {a.decode_ep} must divide --decode-tp {a.decode_tp}")
    if a.decode_precision == "mxfp4" and a.decode_tp > 1:
        from pdserve.launch.cli import CLIError

        raise CLIError("--decode-precision mxfp4 keeps the experts as published on one rank: use --decode-tp 1")
    policy = RestartPolicy(max_restarts=a.max_restarts, backoff_s=a.restart_backoff,
                           max_backoff_s=max(a.restart_backoff, RestartPolicy.max_backoff_s))
    spec = ClusterSpec(model=a.model, served_model_name=a.served_model_name, host=a.host, port=a.port,
                       grpc_port=a.grpc_port, prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                       device=a.device, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, decode_ep=a.decode_ep,
                       max_batch_size=a.max_batch_size, kv_blocks=a.kv_blocks,
                       kv_memory_fraction=a.kv_memory_fraction, extra_router_args=serving_argv(a),
                       extra_prefill_args=["--prefix-cache-tokens", str(a.prefix_cache_tokens),
                                           "--prefill-chunk-tokens", str(a.prefill_chunk_tokens),
                                           *projection_precision_argv(a)],
                       extra_decode_args=["--reservation-ttl", str(a.reservation_ttl),
                                          *projection_precision_argv(a),
                                          *(["--precision", a.decode_precision] if a.decode_precision else [])])
    from pdserve.proto.rpc import ensure_port_free

    # before starting anything: a taken port is one line now, not a router failure later
    ensure_port_free(a.host, a.port, "--port")
    ensure_port_free(a.host, a.grpc_port, "--grpc-port")
    stop, stop_now = threading.Event(), threading.Event()
    signals: list[int] = []

    def on_signal(signum, _frame) -> None:
        signals.append(signum)
        if stop.is_set():  # a second Ctrl-C: no more draining
            stop_now.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    cluster = LocalCluster(spec, a.log_dir, cancel=stop)
    print(f"pdserve: starting {spec.prefill_workers} prefill + {spec.decode_workers} decode workers "
          f"({cluster.model}); logs in {cluster.log_dir}", flush=True)
    try:
        cluster.start()
    except StartInterrupted:
        print("pdserve: stopped during start-up", flush=True)
        return 128 + signals[0]
    print(f"pdserve: serving {spec.served_model_name} at {cluster.url}/v1 (gRPC {spec.host}:{spec.grpc_port})"
          " - Ctrl-C to stop", flush=True)
    supervisor = Supervisor(cluster, policy)
    try:
        while not stop.is_set():
            if not supervisor.poll():
                print("pdserve: no router, prefill or decode worker left; stopping", file=sys.stderr, flush=True)
                break
            stop.wait(0.2)
    finally:
        print("pdserve: stopping (Ctrl-C again to stop at once)", flush=True)
        cluster.stop(now=stop_now)
        print("pdserve: stopped", flush=True)
    return 0
