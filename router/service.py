"""The assembled router: registry + policy + orchestrator + HTTP app + gRPC server, and its lifecycle.

`build_router` wires the parts; `serve_router` runs one on the current event loop until a stop
event is set, then shuts down gracefully: health flips to NOT_SERVING, listeners close, in-flight
requests get `graceful_shutdown_timeout` to finish, then workers' channels close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import grpc
import uvicorn

from pdserve.proto.rpc import PortInUse
from pdserve.router.access_log import AccessLog
from pdserve.router.auth import ApiKeyInterceptor, ApiKeyMiddleware, ApiKeys, TLSFiles
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.grpc_server import GeneratorService, HealthReporter, create_grpc_server
from pdserve.router.harmony import HarmonyCodec
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_api import OpenAIFrontend, create_app
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.policy import CacheAwarePolicy, LoadAwarePolicy, RoutingPolicy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import WorkerRegistry
from pdserve.router.responses import ResponsesAPI, ResponseStore
from pdserve.router.tokenizer_api import TokenizerAPI

log = logging.getLogger(__name__)


class Router:
    """One router's parts. Build with `build_router`, run with `serve_router`."""

    def __init__(self, config: RouterConfig, discovery: Discovery, codec: HarmonyCodec,
                 policy: RoutingPolicy, metrics: RouterMetrics,
                 channel_factory: Callable[[str], grpc.aio.Channel] | None = None) -> None:
        self.config = config
        self.discovery = discovery
        self.codec = codec
        self.metrics = metrics
        self.registry = WorkerRegistry(config, metrics, channel_factory)
        metrics.decode_kv_usage.set_function(self.registry.decode_kv_usage)  # read at scrape time
        self.orchestrator = Orchestrator(config, self.registry, policy, metrics)
        self.frontend = OpenAIFrontend(config, self.orchestrator, self.registry, codec, metrics)
        self.app = create_app(self.frontend)
        self.responses = ResponsesAPI(self.frontend, ResponseStore(
            config.responses_store_size, config.responses_store_ttl,
            config.responses_store_max_chars))
        self.responses.register(self.app)
        TokenizerAPI(self.frontend).register(self.app)
        self.api_keys = ApiKeys(config.api_key_file) if config.api_key_file else None
        if self.api_keys is not None:
            self.app.add_middleware(ApiKeyMiddleware, keys=self.api_keys, metrics=metrics)
        self.tls = (TLSFiles(config.tls_cert_file, config.tls_key_file)
                    if config.tls_cert_file else None)
        self.app.add_middleware(AccessLog)  # outside the accounting: logs the status it counts
        self.health = HealthReporter(self.registry)
        self.generator = GeneratorService(config, self.orchestrator, metrics, codec.vocab_size)
        self.grpc_server: grpc.aio.Server | None = None
        self.http_port: int | None = None  # bound ports, known once serving (port 0 = any free)
        self.grpc_port: int | None = None


def build_router(config: RouterConfig, discovery: Discovery, *, codec: HarmonyCodec | None = None,
                 policy: RoutingPolicy | None = None) -> Router:
    """Wire a router; nothing starts until `serve_router`. Tests pass a static discovery."""
    return Router(config, discovery, codec or HarmonyCodec(), policy or policy_from_config(config),
                  RouterMetrics())


def policy_from_config(config: RouterConfig) -> RoutingPolicy:
    if config.routing_policy == "load":
        return LoadAwarePolicy()
    return CacheAwarePolicy(PrefixIndex(capacity_tokens=config.prefix_index_tokens),
                            imbalance_tokens=config.prefix_imbalance_tokens)


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: `serve_router`'s caller owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve_router(router: Router, stop: asyncio.Event,
                       on_ready: Callable[[Router], None] | None = None) -> None:
    """Serve HTTP and gRPC on this loop until `stop` is set, then shut down gracefully.

    `on_ready(router)` runs once both listeners are bound (`router.http_port`/`grpc_port` set).
    """
    config = router.config
    await router.registry.start(router.discovery)
    router.health.update()
    interceptors = [ApiKeyInterceptor(router.api_keys)] if router.api_keys else None
    grpc_server = create_grpc_server(router.generator, router.health, interceptors)
    router.grpc_server = grpc_server
    host = f"[{config.host}]" if ":" in config.host else config.host  # IPv6 literal
    address = f"{host}:{config.grpc_port}"
    try:
        router.grpc_port = (grpc_server.add_secure_port(address, router.tls.grpc_credentials())
                            if router.tls else grpc_server.add_insecure_port(address))
    except RuntimeError:  # grpcio raises where older versions returned 0
        router.grpc_port = 0
    if router.grpc_port == 0:
        raise PortInUse(f"cannot listen on {config.host}:{config.grpc_port}; choose another "
                        "port with --grpc-port")
    await grpc_server.start()
    http = _UvicornServer(uvicorn.Config(
        router.app, host=config.host, port=config.port, log_config=None, lifespan="off",
        timeout_graceful_shutdown=config.graceful_shutdown_timeout, access_log=False,
        **(router.tls.uvicorn_options() if router.tls else {})))
    http_task = asyncio.create_task(http.serve(), name="pdserve-http")
    try:
        while not http.started:
            if http_task.done():
                await http_task  # raises why it could not start
                raise OSError(f"HTTP server on {config.host}:{config.port} did not start")
            await asyncio.sleep(0.01)
        router.http_port = http.servers[0].sockets[0].getsockname()[1]
        log.info("router serving HTTP on %s:%d, gRPC on %s:%d (model %r)", config.host,
                 router.http_port, config.host, router.grpc_port, config.served_model_name)
        if on_ready is not None:
            on_ready(router)
        stop_wait = asyncio.create_task(stop.wait())
        await asyncio.wait([stop_wait, http_task], return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
    finally:
        log.info("router shutting down")
        router.health.shutting_down()
        http.should_exit = True
        await asyncio.gather(http_task, grpc_server.stop(config.graceful_shutdown_timeout),
                             return_exceptions=True)
        await router.orchestrator.drain()
        await router.registry.stop()
