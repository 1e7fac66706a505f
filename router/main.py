"""Router command line: `add_router_args` + `run_router` (used by the `pdserve` CLI and launchers).

    pdserve router --discovery static --prefill 10.0.0.1:50061,10.0.0.2:50061 --decode 10.0.0.3:50071

Adding the flags imports nothing heavy; the servers (uvicorn, FastAPI, gRPC) load in `run_router`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from typing import TYPE_CHECKING

from pdserve.router.config import RouterConfig

if TYPE_CHECKING:
    from pdserve.router.discovery import Discovery

__all__ = ["add_router_args", "add_serving_args", "serving_argv", "run_router", "config_from_args",
           "discovery_from_args"]

log = logging.getLogger(__name__)


# the router flags `pdserve serve` takes too and hands to the router it starts
_SERVING_FLAGS = ("request_timeout", "max_queued_requests", "max_queue_wait", "routing_policy",
                  "max_migrations")


def add_serving_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """How requests are served (timeout, admission queue, placement, migration): flags of
    `pdserve router` that `pdserve serve` takes too; `serving_argv` hands them on."""
    defaults = RouterConfig()
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout,
                   help="seconds a request may take end to end (waiting included)")
    parser.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                   help="requests that may wait at the router for a decode batch slot and KV "
                        "blocks; more get 429 at once (0 = no waiting)")
    parser.add_argument("--max-queue-wait", type=float, default=defaults.max_queue_wait,
                   help="seconds a request may wait for a decode batch slot and KV blocks before "
                        "it gets 429")
    parser.add_argument("--routing-policy", default=defaults.routing_policy, choices=["cache_aware", "load"],
                   help="prefill placement: the worker caching the longest prompt prefix (cache_aware) "
                        "or the least loaded (load)")
    parser.add_argument("--max-migrations", type=int, default=defaults.max_migrations,
                   help="times a stream is re-prefilled and continued elsewhere when its decode "
                        "worker dies or drops it (0 = the stream ends in an error)")


def serving_argv(args: argparse.Namespace) -> list[str]:
    """The `add_serving_args` flags of `args`, as `pdserve router` arguments."""
    return [arg for name in _SERVING_FLAGS
            for arg in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


def add_router_args(parser: argparse.ArgumentParser) -> None:
    defaults = RouterConfig()
    g = parser.add_argument_group("router")
    add_serving_args(g)
    g.add_argument("--host", default=defaults.host, help="address to listen on (HTTP and gRPC)")
    g.add_argument("--port", type=int, default=defaults.port, help="HTTP (OpenAI API) port")
    g.add_argument("--grpc-port", type=int, default=defaults.grpc_port,
                   help="gRPC port (pdserve.v1.Generator and grpc.health.v1)")
    g.add_argument("--served-model-name", default=defaults.served_model_name,
                   help="the model name clients must send")
    g.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens,
                   help="completion budget when the request sets none (capped by the context)")
    g.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                   help="largest request body accepted (larger: HTTP 413)")
    g.add_argument("--max-text-chars", type=int, default=defaults.max_text_chars,
                   help="most characters of text in one request, checked before tokenizing")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=defaults.graceful_shutdown_timeout,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--api-key-file", default=None,
                   help="require `Authorization: Bearer <key>` on /v1 and gRPC; the file holds the "
                        "accepted keys, one per line, and is re-read when it changes")
    g.add_argument("--tls-cert-file", default=None,
                   help="serve HTTPS and gRPC over TLS with this PEM certificate (chain)")
    g.add_argument("--tls-key-file", default=None, help="the PEM private key of --tls-cert-file")
    g.add_argument("--breaker-reset-timeout", type=float, default=defaults.breaker_reset_timeout,
                   help="seconds a worker taken out of rotation waits before it is probed again; "
                        "the wait doubles while probes fail")
    g.add_argument("--breaker-max-reset-timeout", type=float, default=defaults.breaker_max_reset_timeout,
                   help="longest wait between probes of a worker out of rotation (how soon one "
                        "restarted on its address is back)")
    g.add_argument("--prefix-imbalance-tokens", type=int, default=defaults.prefix_imbalance_tokens,
                   help="cache_aware: route by load instead when the best match's queue holds this "
                        "many more prompt tokens than the least-loaded worker's")
    g.add_argument("--prefix-index-tokens", type=int, default=defaults.prefix_index_tokens,
                   help="cache_aware: prompt tokens remembered per prefill worker")
    g.add_argument("--responses-store-size", type=int, default=defaults.responses_store_size,
                   help="/v1/responses kept for previous_response_id (store: true), at most")
    g.add_argument("--responses-store-ttl", type=float, default=defaults.responses_store_ttl,
                   help="seconds a stored /v1/responses response is kept")
    g.add_argument("--responses-store-max-chars", type=int,
                   default=defaults.responses_store_max_chars,
                   help="characters all stored /v1/responses responses may hold together")
    g.add_argument("--discovery", default="static", help="worker discovery: static | kubernetes | ray")
    g.add_argument("--prefill", action="append", default=None, metavar="ADDR,...",
                   help="static discovery: prefill worker host:port list (repeatable)")
    g.add_argument("--decode", action="append", default=None, metavar="ADDR,...",
                   help="static discovery: decode worker host:port list (repeatable)")
    g.add_argument("--k8s-namespace", default=None, help="kubernetes discovery: namespace")
    g.add_argument("--k8s-prefill-selector", default=None,
                   help="kubernetes discovery: label selector of the prefill workers")
    g.add_argument("--k8s-decode-selector", default=None,
                   help="kubernetes discovery: label selector of the decode workers")
    g.add_argument("--k8s-port-name", default="grpc",
                   help="kubernetes discovery: name of the workers' gRPC port")
    g.add_argument("--ray-namespace", default="pdserve",
                   help="ray discovery: namespace of the worker actors (see launch/ray_job.py)")
    g.add_argument("--log-level", default="info", help="router log level")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """A RouterConfig of the flags named after its fields (the rest keep their defaults)."""
    return RouterConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(RouterConfig)
                           if hasattr(args, field.name)})


def discovery_from_args(args: argparse.Namespace) -> Discovery:
    from pdserve.router.discovery import make_discovery

    if args.discovery == "static":
        return make_discovery("static", prefill=args.prefill, decode=args.decode)
    if args.discovery == "kubernetes":
        return make_discovery("kubernetes", namespace=args.k8s_namespace,
                              prefill_selector=args.k8s_prefill_selector,
                              decode_selector=args.k8s_decode_selector,
                              port_name=args.k8s_port_name)
    if args.discovery == "ray":
        return make_discovery("ray", namespace=args.ray_namespace)
    return make_discovery(args.discovery)


def run_router(args: argparse.Namespace) -> None:
    """Run the router until SIGTERM/SIGINT, then shut down gracefully (blocks)."""
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.proto.rpc import ensure_port_free
    from pdserve.router.service import build_router, serve_router

    config = config_from_args(args)
    ensure_port_free(config.host, config.port, "--port")
    ensure_port_free(config.host, config.grpc_port, "--grpc-port")
    router = build_router(config, discovery_from_args(args))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_router(router, stop)

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve-router", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_router_args(parser)
    run_router(parser.parse_args(argv))


if __name__ == "__main__":
    main()
