"""gRPC plumbing shared by the workers: a threaded server with standard health checking, bound
to a given address (port 0 picks a free one), and the ready file launchers wait for; the check
that a listen address is free, made before a server spends minutes loading a model."""

from __future__ import annotations

import errno
import json
import os
import socket
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2

# Large enough for every in-flight stream (one handler thread each) plus control calls.
MAX_MESSAGE_BYTES = 64 << 20


def make_server(max_workers: int) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0),
                 # the router pings busy channels every 20 s to notice vanished hosts
                 ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
                 ("grpc.http2.max_ping_strikes", 0),
                 ("grpc.keepalive_permit_without_calls", 1)],
    )


def add_health(server: grpc.Server, services: list[str]) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *services]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def set_serving(servicer: health.HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        servicer.set(name, status)


class PortInUse(OSError):
    """A listen address is taken (or unusable); the message names the flag that sets it."""


def ensure_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raise `PortInUse` unless `host:port` can be listened on now (port 0 always can)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortInUse(f"{host}:{port} is already in use (is another server running "
                                f"there?); choose another port with {flag}") from None
            raise PortInUse(f"cannot listen on {host}:{port} ({flag}): "
                            f"{error.strerror or error}") from None


def bind(server: grpc.Server, host: str, port: int, flag: str = "--port") -> int:
    """Bind an insecure port; returns the port actually bound (port 0 = any free one)."""
    ensure_port_free(host, port, flag)  # a clear error rather than gRPC's log line
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:  # taken between the check and now
        bound = 0
    if bound == 0:
        raise PortInUse(f"cannot listen on {target}; choose another port with {flag}")
    return bound


def write_ready_file(path: str | None, **info) -> None:
    """Atomically write what a launcher needs to reach this process (address, role, pid)."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    os.replace(tmp, path)


def sampling_kwargs(s) -> dict:
    """pdserve.v1.SamplingParams -> keyword arguments of engine.sampling.SamplingParams."""
    return dict(
        temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        n=max(1, s.n), grammar=s.grammar,
    )


def logprob_message(lp) -> pdserve_pb2.TokenLogprob:
    """engine.sampling.TokenLogprob -> pdserve.v1.TokenLogprob."""
    return pdserve_pb2.TokenLogprob(token_id=lp.token, logprob=lp.logprob,
                                    top_token_ids=[t for t, _ in lp.top],
                                    top_logprobs=[x for _, x in lp.top])
