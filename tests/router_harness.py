"""In-test prefill/decode gRPC workers and a router running in a thread, for the router tests.

The workers implement the real `pdserve.v1` services over real gRPC with simple deterministic
behaviour: a shared token script plays the model (prefill returns its first id, decode streams
the rest until a stop id or max_new_tokens), and `KVFabric` plays NIXL (prefill marks the KV of a
request as written into the decode worker named by the placement; decode refuses requests whose
KV has not arrived). Each can be told to fail, die (its server stops), fill up or hang.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent import futures

import grpc
import httpx
import openai_harmony
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import make_discovery
from pdserve.router.harmony import HarmonyCodec, ensure_offline_vocab
from pdserve.router.service import Router, build_router, serve_router


@functools.lru_cache(maxsize=1)
def codec() -> HarmonyCodec:
    return HarmonyCodec()


@functools.lru_cache(maxsize=1)
def _encoding() -> openai_harmony.HarmonyEncoding:
    ensure_offline_vocab()
    return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_ids(text: str) -> list[int]:
    """Token ids of Harmony text (special tokens spelled out), as the model would sample them."""
    return _encoding().encode(text, allowed_special="all")


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ListDiscovery:
    """A discovery backend whose worker set the test changes, as EndpointSlice updates would."""

    def __init__(self, endpoints):
        self.endpoints = list(endpoints)
        self.on_change = None
        self.stopped = False

    def start(self, on_change):
        self.on_change = on_change
        on_change(list(self.endpoints))

    def set(self, endpoints):
        self.endpoints = list(endpoints)
        self.on_change(list(self.endpoints))

    def stop(self):
        self.stopped = True


class KVFabric:
    """Which (decode worker, request id) pairs have received their KV from a prefill."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: set[tuple[str, str]] = set()

    def write(self, decode_worker_id: str, request_id: str) -> None:
        with self._lock:
            self._arrived.add((decode_worker_id, request_id))

    def arrived(self, decode_worker_id: str, request_id: str) -> bool:
        with self._lock:
            return (decode_worker_id, request_id) in self._arrived


class Script:
    """The "model": the ids it samples after any prompt (first one from prefill)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = list(token_ids)


class _Server:
    """A gRPC server for one fake worker, with standard health checking."""

    def __init__(self, add_servicer, servicer, port: int = 0) -> None:
        self._add_servicer, self._servicer = add_servicer, servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=[
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # router keepalive
            ("grpc.http2.max_ping_strikes", 0)])
        add_servicer(servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()
        self.alive = True

    def revive(self) -> None:
        """A dead worker started again on its address (what a supervisor's restart looks like)."""
        assert not self.alive
        self.server.stop(0).wait()
        self.__init__(self._add_servicer, self._servicer, self.port)

    def die(self) -> None:
        """Stop serving at once, in-flight calls included (what a crashed process looks like)."""
        if self.alive:
            self.alive = False
            threading.Thread(target=self.server.stop, args=(0,), daemon=True).start()

    def set_serving(self, serving: bool) -> None:
        self.health.set("", health_pb2.HealthCheckResponse.SERVING if serving
                        else health_pb2.HealthCheckResponse.NOT_SERVING)


class FakeDecode(pbg.DecodeWorkerServicer):
    def __init__(self, name: str, fabric: KVFabric, script: Script, *, page_size: int = 16,
                 kv_blocks_total: int = 4096, max_context: int = 8192, sliding_window: int = 0) -> None:
        """sliding_window > 0: the model has sliding-window layers of that many keys, whose pages
        come from the same pool (engine/kv_cache.py)."""
        self.name, self.fabric, self.script = name, fabric, script
        self.page_size, self.kv_blocks_total, self.max_context = page_size, kv_blocks_total, max_context
        self.sliding_window_pages = -(-sliding_window // page_size) + 1 if sliding_window else 0
        self.lock = threading.Lock()
        self.reservations: dict[str, int] = {}
        self.reserve_requests: list[pb.ReserveRequest] = []
        self.decode_requests: list[pb.DecodeRequest] = []
        self.cancelled: list[str] = []
        self.exhausted = False          # Reserve answers RESOURCE_EXHAUSTED, Load says full
        self.refuse_reserve = False     # Reserve answers RESOURCE_EXHAUSTED, Load says free (stale)
        self.chunk_size = 2
        self.token_delay = 0.0          # seconds before each chunk
        self.reserve_delay = 0.0        # seconds Reserve takes
        self.peak_kv_blocks = self.peak_requests = 0
        self.max_batch_size = 64        # what Load reports
        self.die_after_chunks: int | None = None
        self.hold = threading.Event()   # cleared: Decode streams wait before each chunk
        self.hold.set()
        self.kv_selftest = 0.0          # kv_selftest_bytes_per_second its LoadReports carry
        self.server = _Server(pbg.add_DecodeWorkerServicer_to_server, self)

    @property
    def address(self) -> str:
        return self.server.address

    def reset(self) -> None:
        with self.lock:
            self.reservations.clear()
            self.reserve_requests.clear()
            self.decode_requests.clear()
            self.cancelled.clear()
        self.exhausted = self.refuse_reserve = False
        self.chunk_size, self.token_delay, self.die_after_chunks = 2, 0.0, None
        self.reserve_delay, self.peak_kv_blocks, self.peak_requests = 0.0, 0, 0
        self.max_batch_size = 64
        self.hold.set()

    def Reserve(self, request, context):
        with self.lock:
            self.reserve_requests.append(request)
        time.sleep(self.reserve_delay)
        if self.exhausted or self.refuse_reserve:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        total = request.num_prompt_tokens + request.max_new_tokens
        pages = -(-total // self.page_size)
        # as the block manager: each later choice shares the prompt's complete pages; every choice
        # holds its own sliding-window pages, as many as the window spans
        blocks = pages + (max(1, request.n) - 1) * (pages - request.num_prompt_tokens // self.page_size)
        blocks += max(1, request.n) * min(self.sliding_window_pages, pages)
        with self.lock:
            used = sum(self.reservations.values())
            if used + blocks > self.kv_blocks_total:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
            self.reservations[request.request_id] = blocks
            self.peak_kv_blocks = max(self.peak_kv_blocks, used + blocks)
            self.peak_requests = max(self.peak_requests, len(self.reservations))
        return pb.ReserveResponse(placements=[pb.KVPlacement(
            decode_worker_id=self.name, kv_agent_name=f"{self.name}-rank0",
            full_block_ids=list(range(pages)), page_size=self.page_size, tp_rank=0, tp_size=1)])

    def Decode(self, request, context):
        rid = request.request_id
        with self.lock:
            self.decode_requests.append(request)
            reserved = rid in self.reservations
        if not reserved:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation for {rid}")
        if not self.fabric.arrived(self.name, rid):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV of {rid} has not arrived")
        choices = max(1, request.sampling.n)
        for choice in range(choices):  # n > 1: each choice plays the script in turn
            if rid in self.cancelled or not context.is_active():
                return
            for chunk in self._play(request, context, last=choice == choices - 1):
                chunk.choice = choice
                yield chunk

    def _play(self, request, context, *, last: bool):
        rid = request.request_id
        sampling = request.sampling
        stops = set(sampling.stop_token_ids)
        script = self.script.token_ids
        start = request.num_generated  # a migrated stream goes on where it was
        if any(first != script[start] for first in [request.first_token_id, *request.first_token_ids]):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first token does not follow the script")
        produced = start + 1
        if script[start] in stops:
            yield pb.TokenChunk(finish_reason=pb.FINISH_REASON_STOP)
            return
        chunk: list[int] = []
        chunks = 0
        for token in script[start + 1:]:
            if rid in self.cancelled or not context.is_active():
                return
            chunk.append(token)
            produced += 1
            finish = (pb.FINISH_REASON_STOP if token in stops else
                      pb.FINISH_REASON_LENGTH if produced >= sampling.max_new_tokens else 0)
            if len(chunk) == self.chunk_size or finish:
                self.hold.wait()
                if self.token_delay:
                    time.sleep(self.token_delay)
                if self.die_after_chunks is not None and chunks >= self.die_after_chunks:
                    self.server.die()
                    time.sleep(1.0)
                    return
                if finish and last:  # as a decode worker frees a finished request before its last chunk
                    # goes out: the router may place the next one the moment it reads this chunk,
                    # before this generator resumes
                    with self.lock:
                        self.reservations.pop(rid, None)
                yield pb.TokenChunk(token_ids=chunk, finish_reason=finish)
                chunks += 1
                chunk = []
            if finish:
                return
        yield pb.TokenChunk(token_ids=chunk, finish_reason=pb.FINISH_REASON_LENGTH)

    def Cancel(self, request, context):
        with self.lock:
            self.cancelled.append(request.request_id)
            found = self.reservations.pop(request.request_id, None) is not None
        return pb.CancelResponse(found=found)

    def Load(self, request, context):
        with self.lock:
            used = sum(self.reservations.values())
            running = len(self.reservations)
        used = self.kv_blocks_total if self.exhausted else used
        return pb.LoadReport(worker_id=self.name, role="decode", running_requests=running,
                             kv_blocks_total=self.kv_blocks_total, kv_blocks_used=used,
                             kv_blocks_free=self.kv_blocks_total - used,
                             max_batch_size=self.max_batch_size,
                             page_size=self.page_size, max_context=self.max_context,
                             kv_selftest_bytes_per_second=self.kv_selftest,
                             sliding_window_pages=self.sliding_window_pages)

    def KVMetadata(self, request, context):
        return pb.KVMetadataResponse(peers=[pb.KVPeerInfo(agent_name=f"{self.name}-rank0")])


class FakePrefill(pbg.PrefillWorkerServicer):
    def __init__(self, name: str, fabric: KVFabric, script: Script, *,
                 queued_prompt_tokens: int = 0) -> None:
        self.name, self.fabric, self.script = name, fabric, script
        self.queued_prompt_tokens = queued_prompt_tokens
        self.lock = threading.Lock()
        self.requests: list[pb.PrefillRequest] = []
        self.cancelled: list[str] = []
        self.mode = "ok"  # ok | unavailable | exhausted | die | hang
        self.unreachable_decode: str | None = None  # KV writes to this decode worker fail
        self.delay = 0.0  # seconds a prefill takes
        self.server = _Server(pbg.add_PrefillWorkerServicer_to_server, self)

    @property
    def address(self) -> str:
        return self.server.address

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.cancelled.clear()
        self.mode, self.unreachable_decode, self.delay = "ok", None, 0.0

    def Prefill(self, request, context):
        with self.lock:
            self.requests.append(request)
        if self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining")
        if self.mode == "exhausted":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue is full")
        if self.mode == "die":
            self.server.die()
            time.sleep(1.0)
            context.abort(grpc.StatusCode.INTERNAL, "unreachable: the server is gone")
        if self.mode == "hang":
            while context.is_active() and request.request_id not in self.cancelled:
                time.sleep(0.01)
            context.abort(grpc.StatusCode.CANCELLED, "cancelled")
        time.sleep(self.delay)
        if not request.placements:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no KV placements")
        if request.placements[0].decode_worker_id == self.unreachable_decode:
            context.abort(grpc.StatusCode.ABORTED, "KV transfer to the decode worker failed")
        self.fabric.write(request.placements[0].decode_worker_id, request.request_id)
        first = self.script.token_ids[request.num_generated]
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=first,
                                  first_token_ids=[first] * request.sampling.n if request.sampling.n > 1 else [],
                                  kv_bytes=1024 * len(request.prompt_token_ids),
                                  kv_transfer_seconds=0.002, queue_seconds=0.001,
                                  compute_seconds=0.003)

    def Cancel(self, request, context):
        with self.lock:
            self.cancelled.append(request.request_id)
        return pb.CancelResponse(found=True)

    def Load(self, request, context):
        return pb.LoadReport(worker_id=self.name, role="prefill",
                             queued_prompt_tokens=self.queued_prompt_tokens)


def fast_config(**overrides) -> RouterConfig:
    values = dict(port=0, grpc_port=0, probe_interval=0.05, probe_timeout=0.5,
                  breaker_reset_timeout=30.0, graceful_shutdown_timeout=1.0,
                  retry_base_delay=0.01, retry_max_delay=0.05, served_model_name="gpt-oss-test",
                  max_queued_requests=0)  # back-pressure at once; admission tests turn it on
    values.update(overrides)
    return RouterConfig(**values)


class RouterThread:
    """A router serving on 127.0.0.1 (free ports) on its own event loop in a thread."""

    def __init__(self, prefill: list[str], decode: list[str], *, discovery=None, **config) -> None:
        """Static discovery of `prefill` and `decode`, or the given `discovery` backend."""
        discovery = discovery or make_discovery("static", prefill=prefill, decode=decode)
        self.router: Router = build_router(fast_config(**config), discovery, codec=codec())
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="router")
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError("router did not start")
        if self._error:
            raise self._error
        self.base_url = f"http://127.0.0.1:{self.router.http_port}"
        self.grpc_address = f"127.0.0.1:{self.router.grpc_port}"

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve_router(self.router, self._stop, on_ready=lambda _: self._ready.set())
        try:
            asyncio.run(main())
        except BaseException as error:  # surfaced to the test thread
            self._error = error
            self._ready.set()

    def wait_ready(self, timeout: float = 10.0) -> None:
        ok = wait_for(lambda: httpx.get(f"{self.base_url}/health").status_code == 200, timeout)
        if not ok:
            raise RuntimeError("router never became healthy")

    def call(self, fn, timeout: float = 5.0):
        """Run `fn()` on the router's loop (to read its state safely) and return the result."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def close(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)


class Cluster:
    """Fake prefill and decode workers sharing one script and KV fabric, plus a router."""

    def __init__(self, num_prefill: int = 2, num_decode: int = 2, *, script: list[int],
                 prefill_queued: list[int] | None = None, decode_kv_blocks: list[int] | None = None,
                 max_context: int = 8192, router_config: dict | None = None, sliding_window: int = 0) -> None:
        self.fabric = KVFabric()
        self.script = Script(script)
        queued = prefill_queued or [0] * num_prefill
        self.prefill = [FakePrefill(f"prefill-{i}", self.fabric, self.script,
                                    queued_prompt_tokens=queued[i]) for i in range(num_prefill)]
        blocks = decode_kv_blocks or [4096] * num_decode
        self.decode = [FakeDecode(f"decode-{i}", self.fabric, self.script, max_context=max_context,
                                  kv_blocks_total=blocks[i], sliding_window=sliding_window)
                       for i in range(num_decode)]
        self.router = RouterThread([p.address for p in self.prefill],
                                   [d.address for d in self.decode], **(router_config or {}))
        self.router.wait_ready()

    @property
    def base_url(self) -> str:
        return self.router.base_url

    def reset(self, script: list[int] | None = None) -> None:
        """The workers back to their defaults, and the router's view of them too: it sees a worker
        through its load reports, so a decode worker that a test left full would otherwise stay full
        to the router (skipped by placement) until its next report came in."""
        for worker in self.prefill + self.decode:
            worker.reset()
        if script is not None:
            self.script.token_ids = list(script)

        def settled() -> bool:
            return all(w.free_kv_blocks == w.load.kv_blocks_total
                       for w in self.router.router.registry.routable("decode"))

        if not wait_for(lambda: self.router.call(settled)):
            raise RuntimeError("the router still sees decode KV blocks in use after the reset")

    def close(self) -> None:
        for worker in self.decode:
            worker.hold.set()
        self.router.close()
        for worker in self.prefill + self.decode:
            worker.server.die()
