"""A rank's place in its worker's parallel groups, the collectives the model needs, and the group
of processes that runs one worker.

A worker of `world_size` ranks runs attention tensor-parallel over all of them (query and KV heads
split) and the MoE as an EP x TP grid: experts split over `ep_size` groups, each expert's
intermediate dimension over `world_size // ep_size` ranks. Rank r is (ep_rank, moe_tp_rank) =
divmod(r, moe_tp_size). Vocabulary-parallel embedding and unembedding split over all ranks, in
equal shards (the last one padded with zero rows) so the logits gather is one all_gather.

TP dispatch/combine: the MoE input is replicated on every rank (it is the output of the
attention all-reduce); every rank routes all tokens with the full router, runs only its local
experts on the tokens routed to them, over its slice of their intermediate channels (the down
bias is added by moe_tp_rank 0 only), weights and sums its partial outputs in float32; the sum
over ranks is one all-reduce per MoE layer.

Processes: rank 0 (the "leader") runs the server and all scheduling; it starts ranks 1..W-1 as
child processes (`RankProcesses`) and, each engine step, broadcasts a small picklable command over
a gloo "metadata" group; all ranks then run the same forward, whose collectives go over the
default group (NCCL on GPUs, gloo on CPU). A rank that dies, or a collective that fails, takes the
whole worker down: every rank is terminated and the leader exits non-zero. A one-rank worker is a
group of one (`start_group`): no process, no collective, the same calls.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    rank: int = 0
    world_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise ValueError(f"EP {self.ep_size} does not divide {self.world_size} ranks")

    @property
    def tp_rank(self) -> int:  # attention / vocabulary
        return self.rank

    @property
    def tp_size(self) -> int:
        return self.world_size

    @property
    def moe_tp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    def split(self, n: int, parts: int, index: int, what: str) -> tuple[int, int]:
        if n % parts:
            raise ValueError(f"{what} ({n}) is not divisible by {parts}")
        step = n // parts
        return index * step, (index + 1) * step

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        return self.split(num_kv_heads, self.tp_size, self.tp_rank, "num_key_value_heads")

    def q_head_range(self, num_heads: int) -> tuple[int, int]:
        return self.split(num_heads, self.tp_size, self.tp_rank, "num_attention_heads")

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        return self.split(num_experts, self.ep_size, self.ep_rank, "num_local_experts")

    def vocab_shard_size(self, vocab: int) -> int:
        """Rows of every rank's embedding shard (ceil(vocab / tp)); the last is zero-padded."""
        return -(-vocab // self.tp_size)

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """Real vocabulary rows [start, end) of this rank (end - start <= vocab_shard_size)."""
        step = self.vocab_shard_size(vocab)
        return min(vocab, self.tp_rank * step), min(vocab, (self.tp_rank + 1) * step)


def check_layout(cfg, world_size: int, ep_size: int = 1) -> ShardSpec:
    """Raise ConfigError (with what to change) unless the model splits over `world_size` ranks in
    `ep_size` expert groups; returns rank 0's ShardSpec."""
    from .config import ConfigError

    if world_size < 1 or ep_size < 1 or world_size % ep_size:
        raise ConfigError(f"EP {ep_size} must be >= 1 and divide the worker's {world_size} ranks (TP)")
    checks = [
        ("num_attention_heads", cfg.num_attention_heads, world_size, "TP"),
        ("num_key_value_heads", cfg.num_key_value_heads, world_size, "TP"),
        ("num_local_experts", cfg.num_local_experts, ep_size, "EP"),
        ("intermediate_size", cfg.intermediate_size, world_size // ep_size, "TP/EP"),
    ]
    for what, n, parts, flag in checks:
        if n % parts:
            raise ConfigError(f"the model's {what} ({n}) does not split over {flag}={parts}; "
                              f"choose a {flag} that divides it")
    return ShardSpec(0, world_size, ep_size)


def all_reduce(t: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """Sum over the worker's ranks (in float32 for bf16 inputs: the reduction order must not
    change the result more than one bf16 rounding)."""
    if shard.world_size == 1:
        return t
    buf = t.float() if t.dtype == torch.bfloat16 else t
    dist.all_reduce(buf)
    return buf.to(t.dtype)


def all_gather_last(t: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """Concatenate each rank's [..., n] along the last dim (vocab-parallel logits; every rank's
    n is the same: vocabulary shards are padded to equal size)."""
    if shard.world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(shard.world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


# -- process groups ---------------------------------------------------------------------------
# Followers wait in the metadata group for the leader's next command for as long as the worker is
# idle, so its timeout is effectively unbounded; a dead peer still breaks it at once (the socket
# closes). The model's collectives run in lockstep and must finish in `timeout_s`.
_IDLE_TIMEOUT = timedelta(days=3650)


class WorkerGroupError(RuntimeError):
    """A rank of the worker died or a collective failed: the worker cannot go on."""


@dataclass
class WorkerGroup:
    """This process's membership: its shard, the device it computes on, the metadata group."""

    shard: ShardSpec
    device: torch.device
    meta: Any  # gloo ProcessGroup for host-side objects

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def is_leader(self) -> bool:
        return self.shard.rank == 0


def init_worker_group(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    *,
    ep_size: int = 1,
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
) -> WorkerGroup:
    """Join the worker's process group as `rank` (default group: NCCL on CUDA, gloo on CPU;
    plus a gloo group for metadata). On CUDA rank r computes on cuda:r of the visible devices.

    init_method: "file:///path" or "tcp://host:port", the same for every rank.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.device_count() < world_size:
            raise WorkerGroupError(
                f"a worker of {world_size} ranks needs {world_size} visible GPUs, "
                f"found {torch.cuda.device_count()} (check CUDA_VISIBLE_DEVICES)")
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    meta = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return WorkerGroup(ShardSpec(rank, world_size, ep_size), dev, meta)


def destroy_worker_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj: Any, group: WorkerGroup) -> Any:
    """The leader's `obj` on every rank (followers pass None)."""
    if group.shard.world_size == 1:
        return obj
    buf = [obj]
    dist.broadcast_object_list(buf, src=0, group=group.meta)
    return buf[0]


def gather_objects(obj: Any, group: WorkerGroup) -> list | None:
    """Every rank's `obj`, in rank order, on the leader (None on followers)."""
    if group.shard.world_size == 1:
        return [obj]
    out = [None] * group.shard.world_size if group.is_leader else None
    dist.gather_object(obj, out, dst=0, group=group.meta)
    return out


# -- leader: the follower processes -----------------------------------------------------------
class RankProcesses:
    """Ranks 1..W-1 of a worker as child processes of the leader, watched by a thread.

    `target(rank, *args_for(rank))` is a follower's entry point (importable: processes are
    spawned). When a follower exits while the worker runs, `on_death(reason)` is called once from
    the watcher thread; until a `LeaderGroup` takes over, that ends the leader at once (it may be
    blocked joining the process group). `stop` asks nothing of the followers (the leader first
    sends them "stop"); it waits, then terminates and kills whatever is left, so no rank outlives
    the leader's shutdown.
    """

    def __init__(self, world_size: int, target: Callable, args_for: Callable[[int], tuple]):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=target, args=(r, *args_for(r)), name=f"rank{r}", daemon=False)
                      for r in range(1, world_size)]
        self._stopping = threading.Event()
        self.on_death: Callable[[str], None] = self._die
        self._watcher = threading.Thread(target=self._watch, name="rank-watcher", daemon=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self._watcher.start()

    def _die(self, reason: str) -> None:
        log.error("%s while the worker was starting; exiting", reason)
        self.stop(timeout_s=0)
        logging.shutdown()
        os._exit(1)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            for p in self.procs:
                if p.exitcode is not None and not self._stopping.is_set():
                    self._stopping.set()
                    self.on_death(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}")
                    return
            self._stopping.wait(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        end = time.monotonic() + timeout_s
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            if p.pid is not None:
                p.join(3.0)
                if p.is_alive():
                    p.kill()
                    p.join(3.0)


def rendezvous_dir() -> str:
    """A fresh directory for the group's file:// rendezvous (the caller removes it)."""
    return tempfile.mkdtemp(prefix="pdserve-group-")


def rendezvous_dir_of(init_method: str) -> str | None:
    """The directory of a file:// init method made by `rendezvous_dir` (None for tcp://)."""
    return os.path.dirname(init_method[len("file://"):]) if init_method.startswith("file://") else None


def cpu_threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one of `world_size` ranks sharing this host's cores (CPU workers)."""
    return max(1, (os.cpu_count() or 1) // world_size)


class LeaderGroup:
    """The leader's side of a worker group: broadcasts commands, runs its share, collects replies.

    Commands are (name, payload, want_reply) triples; followers run the handler registered under
    `name` (see `follow`). Any failure here (a collective error or timeout, a dead rank) is fatal
    for the worker: `fatal` runs the registered callbacks (mark NOT_SERVING, wake the main thread)
    and, if the process has not exited `exit_grace_s` later, terminates every rank and exits.
    """

    def __init__(self, group: WorkerGroup, procs: RankProcesses | None, *, exit_grace_s: float = 30.0,
                 rendezvous: str | None = None):
        self.group = group
        self.procs = procs
        self.rendezvous = rendezvous  # removed by shutdown
        self.exit_grace_s = exit_grace_s
        if procs is not None:
            procs.on_death = self.fatal
        self._lock = threading.Lock()  # one command at a time (gRPC threads, scheduler thread)
        self._fatal: str | None = None
        self._fatal_lock = threading.Lock()
        self._on_fatal: list[Callable[[str], None]] = []

    @property
    def failed(self) -> str | None:
        return self._fatal

    def on_fatal(self, fn: Callable[[str], None]) -> None:
        self._on_fatal.append(fn)

    def fatal(self, reason: str) -> None:
        with self._fatal_lock:
            if self._fatal is not None:
                return
            self._fatal = reason
        log.error("worker group failed: %s; taking the worker down", reason)
        for fn in self._on_fatal:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001 - the exit below must still happen
                log.exception("fatal callback failed")
        threading.Thread(target=self._exit_later, name="fatal-exit", daemon=True).start()

    def _exit_later(self) -> None:
        time.sleep(self.exit_grace_s)
        log.error("worker did not shut down in %.0f s after a fatal error; exiting", self.exit_grace_s)
        if self.procs is not None:
            self.procs.stop(timeout_s=0)
        logging.shutdown()
        os._exit(1)

    def _check(self) -> None:
        if self._fatal is not None:
            raise WorkerGroupError(f"worker group failed: {self._fatal}")

    def call(self, name: str, payload: Any, local: Callable[[Any], Any], want_reply: bool) -> Any:
        """Broadcast a command, run it here, and (want_reply) gather every rank's result."""
        with self._lock:
            self._check()
            try:
                broadcast_object((name, payload, want_reply), self.group)
            except Exception as e:
                self.fatal(f"broadcasting {name!r} failed: {type(e).__name__}: {e}")
                raise WorkerGroupError(str(e)) from e
            try:
                result = local(payload)
            except Exception as e:
                # the followers are inside the same collectives: the group cannot be trusted now
                # (alone, rank 0 fails just this command, as any other exception)
                if self.group.shard.world_size > 1:
                    self.fatal(f"{name!r} failed on rank 0: {type(e).__name__}: {e}")
                raise
            if not want_reply:
                return result
            try:
                return gather_objects(result, self.group)
            except Exception as e:
                self.fatal(f"collecting {name!r} results failed: {type(e).__name__}: {e}")
                raise WorkerGroupError(str(e)) from e

    def run(self, plan: Any, execute: Callable[[Any], Any]) -> Any:
        """One engine step on every rank (the hook ModelRunner calls)."""
        return self.call("step", plan, execute, want_reply=False)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to exit (if the group still works), make sure they did, and leave
        the process group."""
        if self._fatal is None:
            with self._lock:
                try:
                    broadcast_object(("stop", None, False), self.group)
                except Exception as e:  # noqa: BLE001 - they are terminated below anyway
                    log.warning("could not send stop to the followers: %s", e)
        if self.procs is not None:
            self.procs.stop(timeout_s=timeout_s if self._fatal is None else 2.0)
        if self.rendezvous:
            shutil.rmtree(self.rendezvous, ignore_errors=True)
        if self._fatal is None:  # a broken group may hang in teardown: the process exits instead
            destroy_worker_group()


def start_group(world_size: int, ep_size: int, device: str, follower: Callable,
                args_for: Callable[[int], tuple]) -> LeaderGroup:
    """The leader's side of a new worker of `world_size` ranks (1 included: no process, no
    collective, the same interface). Ranks 1..W-1 run `follower(rank, init_method, *args_for(rank))`
    in child processes (see `run_follower`); rank 0 joins their process group here."""
    if world_size == 1:
        return LeaderGroup(WorkerGroup(ShardSpec(0, 1, ep_size), torch.device(device), None), None)
    if torch.device(device).type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    rdv = rendezvous_dir()
    init = f"file://{os.path.join(rdv, 'store')}"
    procs = RankProcesses(world_size, follower, lambda r: (init, *args_for(r)))
    procs.start()
    group = init_worker_group(0, world_size, init, ep_size=ep_size, device=device)
    return LeaderGroup(group, procs, rendezvous=rdv)


# -- followers --------------------------------------------------------------------------------
def watch_parent(parent_pid: int, interval_s: float = 0.5, cleanup_dir: str | None = None) -> None:
    """Exit this process as soon as the leader is gone (no orphaned ranks, even after SIGKILL),
    removing `cleanup_dir` (the group's rendezvous directory, which the leader can no longer)."""

    def loop():
        while True:
            if os.getppid() != parent_pid:
                logging.getLogger(__name__).error("leader (pid %d) is gone; exiting", parent_pid)
                if cleanup_dir:
                    shutil.rmtree(cleanup_dir, ignore_errors=True)
                os._exit(1)
            time.sleep(interval_s)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def run_follower(rank: int, world_size: int, init_method: str, leader_pid: int, ep_size: int, device: str,
                 setup: Callable[[WorkerGroup], tuple[dict[str, Callable[[Any], Any]], Callable[[], None]]]) -> None:
    """A follower rank's whole life: the leader alone decides when it stops (signals ignored), it
    ends as soon as the leader is gone, and any failure exits non-zero (which the leader sees).

    `setup(group)` builds this rank's share of the worker and returns (handlers for `follow`,
    cleanup run after the leader's "stop").
    """
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    watch_parent(leader_pid, cleanup_dir=rendezvous_dir_of(init_method))
    try:
        if torch.device(device).type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        group = init_worker_group(rank, world_size, init_method, ep_size=ep_size, device=device)
        handlers, cleanup = setup(group)
        follow(group, handlers)
    except BaseException:
        log.exception("rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    cleanup()
    destroy_worker_group()


def follow(group: WorkerGroup, handlers: dict[str, Callable[[Any], Any]]) -> None:
    """A follower's life after setup: run the leader's commands until it says "stop".

    An exception in a handler propagates (the caller exits non-zero, which the leader sees):
    handlers that may fail per request (a KV transfer) report the failure in their reply instead.
    """
    while True:
        name, payload, want_reply = broadcast_object(None, group)
        if name == "stop":
            return
        fn = handlers.get(name)
        if fn is None:
            raise WorkerGroupError(f"unknown command {name!r} from the leader")
        result = fn(payload)
        if want_reply:
            gather_objects(result, group)
