"""Run pdserve on a Ray cluster: the router and both pools as Ray actors (the Ray job entry point).

    ray job submit --working-dir . -- python -m pdserve.launch.ray_job --config launch/ray_job.example.yaml

Shape (docs/deploy.md, "Ray job"):

- Each pool replica gets one placement group, one bundle per rank (`{"GPU": 1, "CPU": k}` on
  CUDA, `{"CPU": k}` on CPU) and strategy STRICT_PACK, so a replica never spans nodes.
- A `WorkerReplica` actor in bundle 0 owns the replica's worker *process*: it runs the same
  `pdserve prefill-worker|decode-worker` entry point as every other launcher (one code path), with
  `CUDA_VISIBLE_DEVICES` set to all GPUs of its placement group (the other bundles' GPUs are held
  by `_GpuRank` actors, which is how Ray tells us their ids). Running the worker in a subprocess
  rather than inside the actor keeps the worker's own multi-process TP/EP launch, signal handling
  and CUDA state out of the Ray worker process, and lets the actor supervise it: when the process
  dies, the actor exits and Ray restarts it (up to `max_restarts`) in the same bundle.
- The process runs in its own process group; the group is terminated on `stop()`, killed at
  interpreter exit, and killed by a small detached shell guard if the actor process dies without
  running any Python (SIGKILL, `ray.kill`, OOM killer), so no worker outlives its actor.
- The router runs inside a `RouterActor` (the router needs no GPU and no child processes),
  preferably on the driver's node, so the printed URL is that node's address; the preference is
  soft: a node without room, or a lost node, puts it (or its restart) on another node, and the
  driver prints the new URL. No node with `router.num_cpus` CPUs at all is an error at once. It
  finds workers through the `ray`
  discovery backend (`router.discovery_ray`): the named actors `prefill-*` / `decode-*` of the
  job's Ray namespace.
- The driver prints the URL and blocks. `ray job stop` (SIGTERM) or Ctrl-C tears everything down
  within `RAY_JOB_STOP_WAIT_TIME_S` (3 s by default): the router drains, workers get SIGTERM then
  SIGKILL, actors are killed and placement groups removed. Actors are owned by the driver, so
  even a driver killed outright takes them (and, through the guards, their processes) along.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.ray_job")

ROUTER_ACTOR = "router"
DEVICES = ("cpu", "cuda")


# ---- configuration ---------------------------------------------------------------------------
class RayJobConfigError(ValueError):
    """The job's config file is missing, unreadable or has a bad value; the message names the key."""


class DeploymentError(RuntimeError):
    """The deployment could not be brought up (resources, a worker that failed to start, ...)."""


@dataclass(frozen=True)
class RouterSpec:
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051
    num_cpus: float = 1.0
    discovery_interval_s: float = 2.0
    extra_args: tuple[str, ...] = ()  # more `pdserve router` flags, e.g. --default-max-tokens
    max_restarts: int = -1  # stateless: restarted (on another node if its node is gone) without limit
    start_timeout_s: float = 120.0  # for a node with room for it; then a clear error, not a hang


@dataclass(frozen=True)
class PoolSpec:
    """One pool; a replica is one worker process group on `tp` ranks of one node."""

    role: str
    replicas: int = 1
    tp: int = 1
    ep: int = 1  # decode only
    max_batch_size: int = 128  # decode only
    kv_blocks: int | None = None  # decode only
    kv_memory_fraction: float | None = None  # decode only
    cpus_per_rank: float = 1.0
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [f"{self.role}-{i}" for i in range(self.replicas)]

    def bundles(self, device: str) -> list[dict[str, float]]:
        """One bundle per rank: the replica's resources, packed onto one node."""
        bundle = {"CPU": self.cpus_per_rank} | ({"GPU": 1} if device == "cuda" else {})
        return [dict(bundle) for _ in range(self.tp)]

    def worker_args(self) -> list[str]:
        args = ["--tp", str(self.tp)]
        if self.role == "decode":
            args += ["--ep", str(self.ep), "--max-batch-size", str(self.max_batch_size)]
            if self.kv_blocks is not None:
                args += ["--kv-blocks", str(self.kv_blocks)]
            if self.kv_memory_fraction is not None:
                args += ["--kv-memory-fraction", str(self.kv_memory_fraction)]
        return args + list(self.extra_args)


@dataclass(frozen=True)
class RayJobConfig:
    model: str = "tiny"  # checkpoint directory present on every node, or "tiny"
    served_model_name: str = "gpt-oss"
    device: str = "cuda"
    namespace: str = "pdserve"  # Ray namespace of the actors: one deployment per namespace
    max_restarts: int = 3  # restarts of a replica whose worker process or actor died (-1: no limit)
    startup_timeout_s: float = 1800.0  # resources + weight loading + first health
    env: dict[str, str] = field(default_factory=dict)  # for every worker, e.g. UCX_NET_DEVICES
    router: RouterSpec = field(default_factory=RouterSpec)
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec("prefill"))
    decode: PoolSpec = field(default_factory=lambda: PoolSpec("decode"))

    @property
    def pools(self) -> tuple[PoolSpec, PoolSpec]:
        return self.prefill, self.decode


# Accepted keys per section and how each is read; anything else is an error (typos fail loudly).
_TOP = {"model": "str", "served_model_name": "str", "device": "str", "namespace": "str",
        "max_restarts": "int", "startup_timeout_s": "float", "env": "env"}
_ROUTER = {"host": "str", "port": "int", "grpc_port": "int", "num_cpus": "float",
           "discovery_interval_s": "float", "extra_args": "args", "max_restarts": "int",
           "start_timeout_s": "float"}
_PREFILL = {"replicas": "int", "tp": "int", "cpus_per_rank": "float", "extra_args": "args",
            "env": "env"}
_DECODE = _PREFILL | {"ep": "int", "max_batch_size": "int", "kv_blocks": "int?",
                      "kv_memory_fraction": "float?"}


def _read(value: Any, kind: str, key: str) -> Any:
    if kind.endswith("?"):
        return None if value is None else _read(value, kind[:-1], key)
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "args" and isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return tuple(str(v) for v in value)
    if kind == "env" and isinstance(value, dict) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value.values()):
        return {str(k): str(v) for k, v in value.items()}
    wanted = {"int": "an integer", "float": "a number", "str": "a string",
              "args": "a list of strings", "env": "a mapping of names to strings"}[kind]
    raise RayJobConfigError(f"{key} must be {wanted}, got {value!r}")


def _section(data: Any, keys: dict[str, str], where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RayJobConfigError(f"{where or 'the config'} must be a mapping, got {data!r}")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise RayJobConfigError(f"unknown key(s) {unknown} in {where or 'the config'}; "
                                f"allowed: {sorted(keys)}")
    return {k: _read(v, keys[k], f"{where}.{k}" if where else k) for k, v in data.items()}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RayJobConfigError(message)


def config_from_dict(data: Any) -> RayJobConfig:
    """Build and validate the job config from a parsed YAML/JSON document."""
    if not isinstance(data, dict):
        raise RayJobConfigError(f"the config must be a mapping of settings, got {data!r}")
    nested = ("router", "prefill", "decode")
    top = _section({k: v for k, v in data.items() if k not in nested}, _TOP, "")
    router = RouterSpec(**_section(data.get("router"), _ROUTER, "router"))
    prefill = PoolSpec("prefill", **_section(data.get("prefill"), _PREFILL, "prefill"))
    decode = PoolSpec("decode", **_section(data.get("decode"), _DECODE, "decode"))
    cfg = RayJobConfig(router=router, prefill=prefill, decode=decode, **top)

    _check(bool(cfg.model), "model must name a checkpoint directory or be 'tiny'")
    _check(bool(cfg.served_model_name), "served_model_name must not be empty")
    _check(cfg.device in DEVICES, f"device must be one of {list(DEVICES)}, got {cfg.device!r}")
    _check(re.fullmatch(r"[A-Za-z0-9_.-]+", cfg.namespace) is not None,
           f"namespace must be letters, digits, '_', '.', '-', got {cfg.namespace!r}")
    _check(cfg.max_restarts >= -1, f"max_restarts must be >= 0 (or -1: no limit), got {cfg.max_restarts}")
    _check(cfg.startup_timeout_s > 0, f"startup_timeout_s must be > 0, got {cfg.startup_timeout_s}")
    for key in ("port", "grpc_port"):
        port = getattr(router, key)
        _check(0 <= port <= 65535, f"router.{key} must be a TCP port (0 = any free one), got {port}")
    _check(router.num_cpus >= 0, f"router.num_cpus must be >= 0, got {router.num_cpus}")
    _check(router.max_restarts >= -1,
           f"router.max_restarts must be >= 0 (or -1: no limit), got {router.max_restarts}")
    _check(router.start_timeout_s > 0, f"router.start_timeout_s must be > 0, got {router.start_timeout_s}")
    _check(router.discovery_interval_s > 0,
           f"router.discovery_interval_s must be > 0, got {router.discovery_interval_s}")
    for pool in cfg.pools:
        r = pool.role
        _check(pool.replicas >= 1, f"{r}.replicas must be >= 1, got {pool.replicas}")
        _check(pool.tp >= 1, f"{r}.tp must be >= 1, got {pool.tp}")
        _check(pool.cpus_per_rank > 0, f"{r}.cpus_per_rank must be > 0, got {pool.cpus_per_rank}")
    _check(decode.ep >= 1 and decode.tp % decode.ep == 0,
           f"decode.ep must divide decode.tp ({decode.tp}), got {decode.ep}")
    _check(1 <= decode.max_batch_size <= 1024,
           f"decode.max_batch_size must be in [1, 1024], got {decode.max_batch_size}")
    _check(decode.kv_blocks is None or decode.kv_blocks >= 1,
           f"decode.kv_blocks must be >= 1, got {decode.kv_blocks}")
    _check(decode.kv_memory_fraction is None or 0 < decode.kv_memory_fraction <= 1,
           f"decode.kv_memory_fraction must be in (0, 1], got {decode.kv_memory_fraction}")
    return cfg


def load_config(path: str | Path) -> RayJobConfig:
    """Read a YAML or JSON config file (JSON is YAML, so one parser reads both)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise RayJobConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RayJobConfigError(f"{path} is not valid YAML/JSON: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise RayJobConfigError(f"{path} must hold a mapping at the top level")
    return config_from_dict(data or {})


# ---- helpers ---------------------------------------------------------------------------------
def _url_host(host: str, node_ip: str) -> str:
    """Where clients reach a server bound to `host` on the node `node_ip`."""
    if host in ("", "0.0.0.0", "::"):
        host = node_ip
    return f"[{host}]" if ":" in host else host


def _guard_process_group(owner_pid: int, pgid: int) -> None:
    """SIGKILL process group `pgid` as soon as `owner_pid` dies, even if it dies by SIGKILL.

    A detached shell loop (its own session, re-parented to init, so Ray's clean-up of the actor's
    children and process group does not take it first) polls both once a second and ends quietly
    when the group is gone; it only kills while the owner is dead.
    """
    loop = (f"while kill -0 {owner_pid} 2>/dev/null && kill -0 -{pgid} 2>/dev/null; do sleep 1; done;"
            f" kill -0 {owner_pid} 2>/dev/null || kill -9 -{pgid} 2>/dev/null")
    subprocess.run(["sh", "-c", f"({loop}) </dev/null >/dev/null 2>&1 &"], check=True,
                   start_new_session=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _cause(error: BaseException) -> BaseException:
    """The exception an actor method raised, without Ray's wrapper."""
    return getattr(error, "cause", None) or error


# ---- actors (wrapped with ray.remote by the driver) ------------------------------------------
class WorkerStartError(RuntimeError):
    """The worker process exited before it served; the message carries its last log lines."""


class _GpuRank:
    """Holds the GPU of one extra rank's bundle, and says which GPU that is."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]


class WorkerReplica:
    """Owns one pool replica's worker process (see the module docstring).

    Threaded actor: `endpoint()` (asked by the router's discovery) answers while `wait_ready()`
    blocks. Its output goes to the actor's log with a `[name]` prefix, so `ray job logs` shows it.
    """

    def __init__(self, name: str, role: str, model: str, device: str, worker_args: list[str],
                 env: dict[str, str], cpus_per_rank: float, gpu_ranks: list[Any],
                 worker_id: str) -> None:
        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.name, self.role = name, role
        self.node_ip = ray.util.get_node_ip_address()
        with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
            warnings.simplefilter("ignore")
            self._restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._ready = threading.Event()
        self._address: str | None = None
        self._exit_code: int | None = None
        self._stopping = False
        self._tmp = Path(tempfile.mkdtemp(prefix=f"pdserve-{name}-"))
        ready_file = self._tmp / "ready.json"
        # Asked again after every restart: a placement group moved off a failed node holds other GPUs.
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        gpu_ids += [g for ids in ray.get([r.gpu_ids.remote() for r in gpu_ranks]) for g in ids]
        cmd = [sys.executable, "-m", "pdserve.launch.cli", f"{role}-worker", "--model", self._model_path(model),
               "--host", self.node_ip, "--port", "0", "--device", device,
               "--ready-file", str(ready_file), "--worker-id", worker_id, *worker_args]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1",
                     "OMP_NUM_THREADS": str(max(1, int(cpus_per_rank)))}
        if device == "cuda":
            child_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        else:
            child_env.setdefault("UCX_TLS", "tcp,self,sm")  # no RDMA devices: DRAM over TCP
        child_env.update(env)
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=child_env, start_new_session=True)
        atexit.register(_signal_group, self._proc.pid, signal.SIGKILL)
        _guard_process_group(os.getpid(), self._proc.pid)
        gpus = f" with GPUs {child_env['CUDA_VISIBLE_DEVICES']}" if device == "cuda" else ""
        print(f"[{name}] started worker pid {self._proc.pid} on {self.node_ip}{gpus}"
              f"{' (restarted)' if self._restarted else ''}: {' '.join(cmd[1:])}", flush=True)
        threading.Thread(target=self._pump, daemon=True, name=f"{name}-log").start()
        threading.Thread(target=self._supervise, args=(ready_file,), daemon=True,
                         name=f"{name}-supervisor").start()

    @staticmethod
    def _model_path(model: str) -> str:
        if model != "tiny":
            return model
        # Made once per node in a short-lived process, so this actor never imports torch.
        out = subprocess.run([sys.executable, "-c", "from launch.serve import builtin_tiny_model as m; "
                              "print(m())"], capture_output=True, text=True)
        if out.returncode != 0:
            raise WorkerStartError(f"could not make the built-in tiny model:\n{out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1]

    def _pump(self) -> None:
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tail.append(line)
            print(f"[{self.name}] {line}", flush=True)

    def _supervise(self, ready_file: Path) -> None:
        while self._proc.poll() is None and not ready_file.is_file():
            time.sleep(0.1)
        if self._proc.poll() is None:
            port = int(json.loads(ready_file.read_text())["address"].rpartition(":")[2])
            self._address = f"{_url_host(self.node_ip, self.node_ip)}:{port}"
            self._ready.set()
        code = self._proc.wait()
        served = self._address is not None
        self._address, self._exit_code = None, code
        self._ready.set()
        _signal_group(self._proc.pid, signal.SIGKILL)  # ranks the worker left behind
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._stopping:
            return
        print(f"[{self.name}] worker process exited with code {code}", file=sys.stderr, flush=True)
        if served or self._restarted:
            # Nobody waits on this incarnation: die so Ray restarts the actor (and its worker) in
            # the same bundle, or marks it dead once max_restarts are used up.
            print(f"[{self.name}] leaving the actor so Ray can restart it", file=sys.stderr, flush=True)
            os._exit(1)

    # -- methods -----------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> dict:
        """Block until the worker serves; its endpoint, or WorkerStartError / TimeoutError."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not serve within {timeout:.0f}s; last output:\n"
                               + "\n".join(self._tail))
        endpoint = self.endpoint()
        if endpoint is None:
            raise WorkerStartError(f"{self.name} exited with code {self._exit_code} before serving; "
                                   "last output:\n" + "\n".join(self._tail))
        return endpoint

    def endpoint(self) -> dict | None:
        """What `router.discovery_ray` asks: None unless the worker process serves right now."""
        if self._address is None or self._proc.poll() is not None:
            return None
        return {"role": self.role, "address": self._address, "name": self.name, "pid": self._proc.pid,
                "node_ip": self.node_ip}

    def stop(self, grace: float) -> int | None:
        """SIGTERM the worker's process group, SIGKILL it after `grace` seconds; its exit code."""
        self._stopping = True
        _signal_group(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=max(0.0, grace))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self._proc.pid, signal.SIGKILL)
        shutil.rmtree(self._tmp, ignore_errors=True)
        return self._proc.wait()


def router_node(nodes: list[dict], driver_node_id: str, num_cpus: float) -> str:
    """The node the router actor should prefer: the driver's when it has `num_cpus` CPUs in all,
    else the first alive node that has. Raises DeploymentError at once when no node could ever
    host it (a head started with --num-cpus=0 and no other CPU node), instead of waiting out the
    start-up timeout. `nodes` is `ray.nodes()`."""
    alive = [n for n in nodes if n.get("Alive")]
    hosts = [n["NodeID"] for n in alive if n.get("Resources", {}).get("CPU", 0.0) >= num_cpus]
    if not hosts:
        have = ", ".join(f"{n.get('NodeManagerAddress', n['NodeID'][:8])}: "
                         f"{n.get('Resources', {}).get('CPU', 0.0):g} CPUs" for n in alive) or "no alive node"
        raise DeploymentError(f"no node of the Ray cluster can host the router: it needs "
                              f"router.num_cpus={num_cpus:g} CPUs and the nodes have {have}; start a "
                              "node with CPUs for Ray (ray start --num-cpus=N) or lower router.num_cpus")
    return driver_node_id if driver_node_id in hosts else hosts[0]


class RouterActor:
    """Runs the router (HTTP + gRPC) on its own event loop thread, with Ray discovery."""

    def __init__(self, router_argv: list[str], namespace: str, discovery_interval_s: float) -> None:
        import ray

        from pdserve.router.discovery_ray import RayDiscovery
        from pdserve.router.main import add_router_args, config_from_args
        from pdserve.router.service import build_router

        parser = argparse.ArgumentParser(prog="router")
        add_router_args(parser)
        args = parser.parse_args(router_argv)
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.node_ip = ray.util.get_node_ip_address()
        discovery = RayDiscovery(namespace=namespace, poll_interval=discovery_interval_s)
        self._router = build_router(config_from_args(args), discovery)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="pdserve-router")
        self._thread.start()

    def _serve(self) -> None:
        from pdserve.router.service import serve_router

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await serve_router(self._router, self._stop, on_ready=lambda _: self._ready.set())

        try:
            asyncio.run(main())
        except BaseException as e:
            log.exception("router stopped with an error")
            served, self._error = self._ready.is_set(), e
            self._ready.set()
            if served and not self._stop.is_set():  # crashed while serving: let Ray restart us
                os._exit(1)

    def wait_ready(self, timeout: float) -> dict:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"router did not bind its ports within {timeout:.0f}s")
        if self._error is not None:
            raise DeploymentError(f"router failed to start: {self._error!r}")
        r = self._router
        return {"node_ip": self.node_ip, "host": r.config.host, "http_port": r.http_port,
                "grpc_port": r.grpc_port}

    def endpoint(self) -> dict:
        return {"role": "router", "node_ip": self.node_ip, "host": self._router.config.host,
                "http_port": self._router.http_port, "grpc_port": self._router.grpc_port}

    def stop(self, timeout: float) -> None:
        """Graceful shutdown (health NOT_SERVING, listeners closed, in-flight requests finish)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=max(0.0, timeout))


# ---- the driver ------------------------------------------------------------------------------
class RayDeployment:
    """Creates, watches and removes one deployment's placement groups and actors."""

    def __init__(self, cfg: RayJobConfig, stop: threading.Event) -> None:
        self.cfg = cfg
        self.stop_event = stop
        self.pgs: dict[str, Any] = {}  # replica name -> placement group
        self.replicas: dict[str, Any] = {}  # replica name -> WorkerReplica handle
        self.helpers: list[Any] = []  # _GpuRank handles
        self.router: Any = None
        self.url: str | None = None
        self.grpc_address: str | None = None
        self.dead: set[str] = set()
        self._abandoned: list[Any] = []  # calls nobody waits for any more (startup failed)
        self._deadline = time.monotonic() + cfg.startup_timeout_s

    # -- bring-up ----------------------------------------------------------------------------
    def start(self) -> str:
        import ray
        from ray.util.placement_group import placement_group

        cfg = self.cfg
        taken = sorted(set(ray.util.list_named_actors()) & {ROUTER_ACTOR, *cfg.prefill.names(),
                                                             *cfg.decode.names()})
        if taken:
            raise DeploymentError(f"Ray namespace {cfg.namespace!r} already holds actors {taken}: another "
                                  "pdserve job runs there; stop it (ray job stop) or set `namespace`")
        self._start_router()
        for pool in cfg.pools:
            for name in pool.names():
                self.pgs[name] = placement_group(pool.bundles(cfg.device), strategy="STRICT_PACK",
                                                 name=f"{cfg.namespace}-{name}")
        self._wait({pg.ready(): name for name, pg in self.pgs.items()}, "placement groups",
                   lambda pending: "waiting for resources for " + ", ".join(
                       f"{n} {self._pool(n).bundles(cfg.device)}" for n in pending)
                   + f"; the cluster has {ray.available_resources()} available")
        for pool in cfg.pools:
            for name in pool.names():
                self._start_replica(pool, name)
        self._wait({self.replicas[n].wait_ready.remote(self._left()): n for n in self.replicas},
                   "workers", lambda pending: f"waiting for {', '.join(pending)} to load and serve")
        self._wait_healthy()
        return self.url

    def _pool(self, name: str) -> PoolSpec:
        return self.cfg.prefill if name.startswith("prefill-") else self.cfg.decode

    def _left(self) -> float:
        return max(1.0, self._deadline - time.monotonic())

    def _start_router(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg, r = self.cfg, self.cfg.router
        argv = ["--host", r.host, "--port", str(r.port), "--grpc-port", str(r.grpc_port),
                "--served-model-name", cfg.served_model_name, "--discovery", "ray", *r.extra_args]
        node = router_node(ray.nodes(), ray.get_runtime_context().get_node_id(), r.num_cpus)
        # soft: the driver's node when it has room (a stable URL), any other node otherwise, and
        # when that node is lost the restarted actor goes wherever there is room
        self.router = ray.remote(RouterActor).options(
            name=ROUTER_ACTOR, num_cpus=r.num_cpus, max_concurrency=4, max_restarts=r.max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
        ).remote(argv, cfg.namespace, r.discovery_interval_s)
        deadline, self._deadline = self._deadline, min(self._deadline, time.monotonic() + r.start_timeout_s)
        try:
            info = self._wait({self.router.wait_ready.remote(60.0): ROUTER_ACTOR}, "router",
                              lambda _: f"waiting for a node with {r.num_cpus:g} free CPUs for the "
                                        f"router; the cluster has {ray.available_resources()} available"
                              )[ROUTER_ACTOR]
        except DeploymentError as e:
            if "not ready within" in str(e):
                raise DeploymentError(
                    f"the router actor was not placed within router.start_timeout_s={r.start_timeout_s:g}s: "
                    f"no node has {r.num_cpus:g} CPUs free (available: {ray.available_resources()}); "
                    "free some, add a node, or lower router.num_cpus") from None
            raise
        finally:
            self._deadline = deadline
        self._router_at(info)

    def _router_at(self, info: dict) -> None:
        host = _url_host(info["host"], info["node_ip"])
        self.url = f"http://{host}:{info['http_port']}"
        self.grpc_address = f"{host}:{info['grpc_port']}"

    def _start_replica(self, pool: PoolSpec, name: str) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, pg = self.cfg, self.pgs[name]

        def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

        gpus = 1 if cfg.device == "cuda" else 0
        ranks = []  # ranks 1..tp-1 hold their bundle's GPU so the replica can ask which it is
        if gpus:
            ranks = [ray.remote(_GpuRank).options(num_cpus=0, num_gpus=1, max_restarts=-1,
                                                  scheduling_strategy=in_bundle(i)).remote()
                     for i in range(1, pool.tp)]
            self.helpers += ranks
        self.replicas[name] = ray.remote(WorkerReplica).options(
            name=name, num_cpus=pool.cpus_per_rank, num_gpus=gpus, max_concurrency=8,
            max_restarts=cfg.max_restarts, scheduling_strategy=in_bundle(0),
        ).remote(name, pool.role, cfg.model, cfg.device, pool.worker_args(), {**cfg.env, **pool.env},
                 pool.cpus_per_rank, ranks, f"{cfg.namespace}-{name}")

    def _wait(self, refs: dict, what: str, progress=None) -> dict[str, Any]:
        """Results of `refs` ({ref: name}) by name; stops early on a stop request or the deadline."""
        import ray
        from ray.exceptions import RayError

        results: dict[str, Any] = {}
        pending = dict(refs)
        next_note = time.monotonic() + 30.0
        while pending:
            stopped, late = self.stop_event.is_set(), time.monotonic() > self._deadline
            if stopped or late:
                self._abandoned += list(pending)
                raise DeploymentError(f"stopped while waiting for {what}" if stopped else
                                      f"{what} not ready within startup_timeout_s="
                                      f"{self.cfg.startup_timeout_s:.0f}s: {sorted(pending.values())}")
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            for ref in done:
                name = pending.pop(ref)
                try:
                    results[name] = ray.get(ref)
                except RayError as e:
                    self._abandoned += list(pending)
                    message = str(_cause(e))
                    if not message.startswith(name):
                        message = f"{name}: {message}"
                    raise DeploymentError(message) from None
            if pending and progress is not None and time.monotonic() > next_note:
                print(f"pdserve: {progress(sorted(pending.values()))}", flush=True)
                next_note = time.monotonic() + 30.0
        return results

    def _wait_healthy(self) -> None:
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.stop_event.is_set():
                raise DeploymentError("stopped while waiting for the router's /health")
            if time.monotonic() > self._deadline:
                raise DeploymentError(f"router at {self.url} not healthy within startup_timeout_s")
            time.sleep(0.5)

    # -- running -----------------------------------------------------------------------------
    def watch(self, interval: float = 5.0) -> int:
        """Block until stopped (0) or until the router or a whole pool is dead for good (1)."""
        actors = {ROUTER_ACTOR: self.router, **self.replicas}
        pending: dict[str, Any] = {}
        try:
            return self._watch(actors, pending, interval)
        finally:
            self._abandoned += list(pending.values())

    def _watch(self, actors: dict[str, Any], pending: dict[str, Any], interval: float) -> int:
        import ray
        from ray.exceptions import RayError

        while not self.stop_event.wait(interval):
            for name, handle in actors.items():
                if name not in self.dead and name not in pending:
                    pending[name] = handle.endpoint.remote()
            if not pending:
                continue
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
            for name, ref in list(pending.items()):
                if ref not in done:
                    continue
                del pending[name]
                try:
                    answer = ray.get(ref)
                    if name == ROUTER_ACTOR and answer.get("node_ip") and self.url:
                        previous = self.url
                        self._router_at(answer)
                        if self.url != previous:  # restarted on another node (its node was lost)
                            print(f"pdserve: the router moved; serving at {self.url}/v1 "
                                  f"(gRPC {self.grpc_address})", flush=True)
                except RayError:
                    try:  # a restarting actor keeps its name; a dead one has released it
                        ray.get_actor(name)
                    except ValueError:
                        self.dead.add(name)
                        print(f"pdserve: {name} is dead (restarts used up)", file=sys.stderr, flush=True)
            roles_alive = {n.split("-")[0] for n in actors if n not in self.dead}
            if not {ROUTER_ACTOR, "prefill", "decode"} <= roles_alive:
                print("pdserve: no router, prefill or decode replica left; stopping", file=sys.stderr,
                      flush=True)
                return 1
        return 0

    # -- tear-down ---------------------------------------------------------------------------
    def teardown(self, budget_s: float) -> None:
        """Drain the router, stop the workers, kill every actor, remove the placement groups."""
        import ray
        from ray.exceptions import RayError
        from ray.util.placement_group import remove_placement_group

        end = time.monotonic() + budget_s
        if self.router is not None:
            ray.wait([self.router.stop.remote(budget_s / 2)], timeout=budget_s / 2 + 0.2)
        refs = [h.stop.remote(max(0.1, end - time.monotonic() - 0.3)) for h in self.replicas.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=max(0.1, end - time.monotonic()))
        for handle in [self.router, *self.replicas.values(), *self.helpers]:
            if handle is not None:
                try:
                    ray.kill(handle, no_restart=True)
                except ValueError:  # never created
                    pass
        for pg in self.pgs.values():
            remove_placement_group(pg)
        if self._abandoned:  # collect their errors, or Ray logs each one as "unhandled"
            done, _ = ray.wait(self._abandoned, num_returns=len(self._abandoned), timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref)
                except RayError:
                    pass


def stop_budget_s() -> float:
    """Seconds the tear-down may take: `ray job stop` SIGKILLs after RAY_JOB_STOP_WAIT_TIME_S."""
    try:
        wait = float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3"))
    except ValueError:
        wait = 3.0
    return max(1.0, wait - 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.launch.ray_job", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML or JSON file (launch/ray_job.example.yaml)")
    ap.add_argument("--address", default=None,
                    help="Ray cluster (default: RAY_ADDRESS, which `ray job submit` sets, else the local one)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(a.config)
    except RayJobConfigError as e:
        print(f"pdserve ray job: error: {e}", file=sys.stderr)
        return 2

    import ray

    ray.init(address=a.address, namespace=cfg.namespace)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    deployment = RayDeployment(cfg, stop)
    pools = ", ".join(f"{p.replicas} {p.role} x tp{p.tp}" for p in cfg.pools)
    print(f"pdserve: starting {pools} on {cfg.device} ({cfg.model}) in Ray namespace {cfg.namespace!r}",
          flush=True)
    rc = 0
    try:
        url = deployment.start()
        print(f"pdserve: serving {cfg.served_model_name} at {url}/v1 (gRPC {deployment.grpc_address})"
              " - `ray job stop` to stop", flush=True)
        rc = deployment.watch()
    except DeploymentError as e:
        if stop.is_set():
            print(f"pdserve: stop requested during start-up ({e})", flush=True)
        else:
            print(f"pdserve ray job: error: {e}", file=sys.stderr, flush=True)
            rc = 1
    finally:
        stop.set()
        deployment.teardown(stop_budget_s())
        print("pdserve: stopped", flush=True)
    return rc


if __name__ == "__main__":
    # Run through the importable module, so Ray pickles the actor classes by reference.
    from pdserve.launch.ray_job import main as _main

    sys.exit(_main())
