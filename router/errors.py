"""Typed router errors: each knows its HTTP status, OpenAI error type and gRPC status code.

Workers speak gRPC status codes; clients get OpenAI-style bodies
`{"error": {"message", "type", "param", "code"}}` (HTTP) or the matching status (gRPC).
"""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Base class; subclasses fix the status. `retry_after` (seconds) becomes a Retry-After header."""

    http_status = 500
    error_type = "internal_error"
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class InvalidRequestError(RouterError):
    """The request itself is wrong (bad field, prompt over the context, bad tool schema)."""

    http_status = 400
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class PayloadTooLargeError(RouterError):
    """The request body is over the router's size limit."""

    http_status = 413
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(RouterError):
    """What the request names does not exist here (a model, a stored response)."""

    http_status = 404
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.NOT_FOUND


class ModelNotFoundError(NotFoundError):

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model '{model}' does not exist; this server serves '{served}'.",
                         param="model", code="model_not_found")


class ConflictError(RouterError):
    """The request names something another request holds (a request id in flight)."""

    http_status = 409
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class OverloadedError(RouterError):
    """No decode KV blocks or every prefill queue is full: the client should retry later."""

    http_status = 429
    error_type = "rate_limit_error"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NoHealthyWorkersError(RouterError):
    """No healthy worker of a needed role (all dead, draining or not discovered yet)."""

    http_status = 503
    error_type = "service_unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class UpstreamError(RouterError):
    """A worker failed the request in a way a retry elsewhere did not (or could not) fix."""

    http_status = 502
    error_type = "upstream_error"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class RequestTimeoutError(RouterError):
    http_status = 504
    error_type = "timeout"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
