"""Every HTTP response counted once: an ASGI middleware around the whole app.

It sees what the handlers cannot: responses made outside them (unknown routes, validation
errors), exceptions nothing else caught (answered here as an OpenAI-shaped 500 instead of the
server's plain-text one), and a client that left before the last byte of its response (499, also
for a stream whose handler had nothing left to send). A streamed body that ends in an error event
started as 200; its handler records the real status in the request's `Outcome`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pdserve.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # status recorded when the client left before the whole answer
_SCOPE_KEY = "pdserve.outcome"
_ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
              "/health": "health", "/metrics": "metrics", "/tokenize": "tokenize",
              "/detokenize": "detokenize", "/tokenizer_info": "tokenizer_info"}


def endpoint_label(path: str) -> str:
    """A bounded label for a request path (unknown paths share one)."""
    for prefix, label in (("/v1/models", "models"), ("/v1/responses", "responses")):
        if path == prefix or path.startswith(prefix + "/"):
            return label
    return _ENDPOINTS.get(path, "other")


class Outcome:
    """What a handler knows about how its response ended that the status line does not say."""

    __slots__ = ("status",)

    def __init__(self) -> None:
        self.status: int | None = None


def outcome_of(scope: dict) -> Outcome:
    """The `Outcome` of the request in `scope` (a throwaway one outside the middleware)."""
    return scope.get(_SCOPE_KEY) or Outcome()


class RequestAccounting:
    """Counts `pdserve_requests_total`, the in-flight gauge and the latency of every response."""

    def __init__(self, app, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope.get("path", ""))
        outcome = scope[_SCOPE_KEY] = Outcome()
        started: int | None = None
        complete = gone = False

        async def receive_watched():
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                gone = True
            return message

        async def send_watched(message) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # a disconnect the server already saw wakes a receiver that has not run yet (a
                # stream whose tokens are all buffered never waits): let it run before the verdict
                await asyncio.sleep(0)
                complete = not gone
            await send(message)

        begin = time.monotonic()
        self.metrics.in_flight.labels(endpoint).inc()
        failed = False
        try:
            await self.app(scope, receive_watched, send_watched)
        except asyncio.CancelledError:
            gone = gone or not complete
            raise
        except BaseException as error:  # incl. BaseExceptions from native code (tokenizer panics)
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            log.exception("%s %s: unhandled error", scope.get("method"), scope.get("path"))
            failed = True
            if started is not None:
                raise  # too late for an error body; the server closes the connection
            await send_watched({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json")]})
            await send_watched({"type": "http.response.body", "body": json.dumps({"error": {
                "message": f"Internal server error: {error!r}", "type": "internal_error",
                "param": None, "code": None}}).encode()})
        finally:
            status = outcome.status = self._status(outcome, started, complete, gone, failed)
            self.metrics.in_flight.labels(endpoint).dec()
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.e2e.labels(endpoint).observe(time.monotonic() - begin)

    @staticmethod
    def _status(outcome: Outcome, started: int | None, complete: bool, gone: bool,
                failed: bool) -> int:
        if failed:
            return 500
        status = outcome.status or started
        if status is None or (status < 400 and not complete):
            return CLIENT_CLOSED if gone else 500
        return status
