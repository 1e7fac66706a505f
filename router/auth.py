"""Optional API-key authentication and TLS for the router's client-facing listeners.

Keys live in a file, one per line (`#` comments and blank lines ignored), e.g. a mounted Kubernetes
Secret. The file is read again when its modification time changes, so a rotated Secret takes
effect without a restart. Clients send `Authorization: Bearer <key>` (what the OpenAI SDKs send
as `api_key`); gRPC callers send the same as `authorization` metadata. `/health` and `/metrics`
and the gRPC health service stay open: probes and Prometheus reach them without keys (the
NetworkPolicy decides who reaches the port at all).

TLS: one certificate and key (PEM) serve both the HTTP and the gRPC port.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.router.accounting import endpoint_label
from pdserve.router.config import ConfigError
from pdserve.router.metrics import RouterMetrics

OPEN_PATHS = frozenset({"/health", "/metrics"})
_OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"


class ApiKeys:
    """The accepted keys, kept as SHA-256 digests and compared in constant time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._mtime_ns: int | None = None
        self._digests: tuple[bytes, ...] = ()
        self._reload()

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
            text = self.path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read the API key file {self.path}: {e.strerror}") from None
        keys = [line.strip() for line in text.splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise ConfigError(f"the API key file {self.path} holds no key (one per line)")
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)
        self._mtime_ns = stat.st_mtime_ns

    def _fresh(self) -> tuple[bytes, ...]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return self._digests  # a Secret being swapped: keep the last good keys
        if mtime != self._mtime_ns:
            with self._lock:
                try:
                    self._reload()
                except ConfigError:
                    pass  # emptied or unreadable for a moment: keep the last good keys
        return self._digests

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries an accepted key."""
        if not authorization:
            return False
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = False
        for accepted in self._fresh():  # no early exit: time does not tell which key matched
            found |= hmac.compare_digest(digest, accepted)
        return found


_UNAUTHORIZED = json.dumps({"error": {
    "message": "Missing or invalid API key: send `Authorization: Bearer <key>`.",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    """ASGI middleware: 401 with an OpenAI error body unless the request carries an accepted key."""

    def __init__(self, app, keys: ApiKeys, metrics: RouterMetrics) -> None:
        self.app, self.keys, self.metrics = app, keys, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if self.keys.accepts(authorization):
            await self.app(scope, receive, send)
            return
        self.metrics.requests.labels(endpoint_label(scope.get("path", "")), "401").inc()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(_UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """gRPC: UNAUTHENTICATED unless `authorization` metadata carries an accepted key (health is open)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata authorization: Bearer <key>")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_GRPC_PREFIX):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if self.keys.accepts(metadata.get("authorization")):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return self._deny_stream if handler.response_streaming else self._deny_unary


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM certificate (chain) and private key for both listeners."""

    cert_file: str
    key_file: str

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file"):
            path = Path(getattr(self, name))
            if not path.is_file():
                raise ConfigError(f"TLS {name.replace('_', ' ')} {path} does not exist")

    def uvicorn_options(self) -> dict:
        return {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}

    def grpc_credentials(self) -> grpc.ServerCredentials:
        key, cert = Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes()
        return grpc.ssl_server_credentials([(key, cert)])
