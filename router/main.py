"""Router command line: `add_router_args` + `run_router` (used by the `pdserve` CLI and launchers).

    pdserve router --discovery static --prefill 10.0.0.1:50061,10.0.0.2:50061 --decode 10.0.0.3:50071

Adding the flags imports nothing heavy; the servers (uvicorn, FastAPI, gRPC) load in `run_router`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from pdserve.router.config import RouterConfig

if TYPE_CHECKING:
    from pdserve.router.discovery import Discovery

__all__ = ["add_router_args", "run_router", "config_from_args", "discovery_from_args"]

log = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    defaults = RouterConfig()
    g = parser.add_argument_group("router")
    g.add_argument("--host", default=defaults.host, help="address to listen on (HTTP and gRPC)")
    g.add_argument("--port", type=int, default=defaults.port, help="HTTP (OpenAI API) port")
    g.add_argument("--grpc-port", type=int, default=defaults.grpc_port,
                   help="gRPC port (pdserve.v1.Generator and grpc.health.v1)")
    g.add_argument("--served-model-name", default=defaults.served_model_name,
                   help="the model name clients must send")
    g.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens,
                   help="completion budget when the request sets none (capped by the context)")
    g.add_argument("--request-timeout", type=float, default=defaults.request_timeout,
                   help="seconds a request may take end to end")
    g.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                   help="largest request body accepted (larger: HTTP 413)")
    g.add_argument("--max-text-chars", type=int, default=defaults.max_text_chars,
                   help="most characters of text in one request, checked before tokenizing")
    g.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                   help="requests that may wait at the router for a decode batch slot and KV "
                        "blocks; more get 429 at once (0 = no waiting)")
    g.add_argument("--max-queue-wait", type=float, default=defaults.max_queue_wait,
                   help="seconds a request may wait for a decode batch slot and KV blocks before "
                        "it gets 429")
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
    g.add_argument("--routing-policy", default=defaults.routing_policy, choices=["cache_aware", "load"],
                   help="prefill placement: the worker caching the longest prompt prefix (cache_aware) "
                        "or the least loaded (load)")
    g.add_argument("--prefix-imbalance-tokens", type=int, default=defaults.prefix_imbalance_tokens,
                   help="cache_aware: route by load instead when the best match's queue holds this "
                        "many more prompt tokens than the least-loaded worker's")
    g.add_argument("--prefix-index-tokens", type=int, default=defaults.prefix_index_tokens,
                   help="cache_aware: prompt tokens remembered per prefill worker")
    g.add_argument("--max-migrations", type=int, default=defaults.max_migrations,
                   help="times a stream is re-prefilled and continued elsewhere when its decode "
                        "worker dies or drops it (0 = the stream ends in an error)")
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
    return RouterConfig(host=args.host, port=args.port, grpc_port=args.grpc_port,
                        served_model_name=args.served_model_name,
                        default_max_tokens=args.default_max_tokens,
                        request_timeout=args.request_timeout,
                        max_request_bytes=args.max_request_bytes,
                        max_text_chars=args.max_text_chars,
                        responses_store_size=args.responses_store_size,
                        responses_store_ttl=args.responses_store_ttl,
                        responses_store_max_chars=args.responses_store_max_chars,
                        max_queued_requests=args.max_queued_requests,
                        max_queue_wait=args.max_queue_wait,
                        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
                        api_key_file=args.api_key_file, tls_cert_file=args.tls_cert_file,
                        tls_key_file=args.tls_key_file,
                        breaker_reset_timeout=args.breaker_reset_timeout,
                        breaker_max_reset_timeout=args.breaker_max_reset_timeout,
                        routing_policy=args.routing_policy,
                        prefix_imbalance_tokens=args.prefix_imbalance_tokens,
                        prefix_index_tokens=args.prefix_index_tokens,
                        max_migrations=args.max_migrations)


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
