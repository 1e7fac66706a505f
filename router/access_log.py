"""One access-log line per HTTP request (logger `pdserve.access`), and a request id to quote.

    127.0.0.1:52144 "POST /v1/chat/completions HTTP/1.1" 200 812.4ms id=5f0c...

The id is the client's `X-Request-Id` when it sent a short printable one, else a fresh one; the
response carries it back in `X-Request-Id`. The status is the one `RequestAccounting` counts
(499 when the client left before the end, the error status of a stream that failed after its
200 line), so the log and `pdserve_requests_total` agree. Successful health and metrics probes
are logged at DEBUG.
"""

from __future__ import annotations

import logging
import time
import uuid

from pdserve.router.accounting import outcome_of
from pdserve.router.request_limits import REQUEST_ID

log = logging.getLogger("pdserve.access")

HEADER = b"x-request-id"
_PROBES = frozenset({"/health", "/metrics"})  # logged at DEBUG unless they fail


class AccessLog:
    """ASGI middleware; install it outside `RequestAccounting` (added after it)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(HEADER, b"")
        sent_id = sent.decode("latin-1")
        request_id = sent_id if REQUEST_ID.fullmatch(sent_id) else uuid.uuid4().hex
        started: int | None = None

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (HEADER, request_id.encode())]}
            await send(message)

        begin = time.monotonic()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            status = outcome_of(scope).status or started or 500
            client = scope.get("client")
            peer = f"{client[0]}:{client[1]}" if client else "-"
            path = scope.get("path")
            quiet = path in _PROBES and status < 400  # probes every few seconds: not news
            log.log(logging.DEBUG if quiet else logging.INFO, '%s "%s %s HTTP/%s" %d %.1fms id=%s',
                    peer, scope.get("method"), path, scope.get("http_version", "1.1"), status,
                    (time.monotonic() - begin) * 1000, request_id)
