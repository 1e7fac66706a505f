"""Typed router configuration, built from CLI flags (router.main) or directly by tests."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A router setting is out of range; the message names the setting."""


@dataclasses.dataclass(slots=True)
class RouterConfig:
    """Everything the router needs besides its worker discovery.

    Times are seconds. Defaults suit production; tests shorten the probe and breaker times.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    served_model_name: str = "gpt-oss"
    default_max_tokens: int = 4096
    request_timeout: float = 600.0
    # untrusted input, bounded before parsing and tokenizing (router/request_limits.py)
    max_request_bytes: int = 8 << 20     # larger bodies get 413
    max_text_chars: int = 1 << 20        # characters of text in one request (~4x a 131k context)
    # /v1/responses kept for previous_response_id (store: true only), in memory
    responses_store_size: int = 1024     # most responses kept (the oldest go first)
    responses_store_ttl: float = 3600.0  # seconds one is kept
    responses_store_max_chars: int = 64 << 20  # characters all kept responses hold together
    # worker health
    probe_interval: float = 1.0          # how often each worker's Load + health are polled
    probe_timeout: float = 1.0           # deadline of one probe RPC
    breaker_failure_threshold: int = 3   # consecutive failed probes/RPCs that open the breaker
    breaker_reset_timeout: float = 5.0   # first wait before an open breaker is probed again
    breaker_max_reset_timeout: float = 60.0
    # request path
    reserve_timeout: float = 10.0        # deadline of Reserve and of each unary control RPC
    cancel_timeout: float = 2.0
    max_prefill_attempts: int = 3        # prefill workers tried per request
    max_decode_attempts: int = 2         # decode workers tried when KV transfer to one fails
    # admission: requests no decode worker has room for wait, first come first served
    max_queued_requests: int = 512       # waiting beyond this: 429 at once (0 = no waiting)
    max_queue_wait: float = 60.0         # seconds one request may wait for room, then 429
    retry_base_delay: float = 0.05       # backoff before retry k is uniform in [0, base * 2**k]
    retry_max_delay: float = 1.0
    overload_retry_after: int = 1        # Retry-After for 429
    unavailable_retry_after: int = 5     # Retry-After for 503
    graceful_shutdown_timeout: float = 30.0
    # client-facing security (router/auth.py): None = open, plain text
    api_key_file: str | None = None      # accepted keys, one per line; /v1 and gRPC need one
    tls_cert_file: str | None = None     # PEM certificate (chain) for HTTPS and gRPC TLS
    tls_key_file: str | None = None
    # prefix caching and migration
    routing_policy: str = "cache_aware"  # cache_aware | load (router.policy)
    prefix_imbalance_tokens: int = 8192  # cache_aware: queued-token gap that overrides a match
    prefix_index_tokens: int = 65536     # cache_aware: tokens remembered per prefill worker
    max_migrations: int = 2              # times a stream moves on when its decode worker fails

    def __post_init__(self) -> None:
        positive = ("request_timeout", "responses_store_ttl", "probe_interval", "probe_timeout", "breaker_reset_timeout",
                    "breaker_max_reset_timeout", "reserve_timeout", "cancel_timeout",
                    "retry_max_delay", "graceful_shutdown_timeout", "max_queue_wait")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("default_max_tokens", "max_request_bytes", "max_text_chars",
                     "responses_store_size", "responses_store_max_chars",
                     "breaker_failure_threshold", "max_prefill_attempts",
                     "max_decode_attempts",
                     "overload_retry_after", "unavailable_retry_after"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be >= 0, got {self.max_queued_requests!r}")
        if self.retry_base_delay < 0:
            raise ConfigError(f"retry_base_delay must be >= 0, got {self.retry_base_delay!r}")
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be a TCP port (0 = any free one), "
                                  f"got {getattr(self, name)!r}")
        if self.routing_policy not in ("cache_aware", "load"):
            raise ConfigError(f"routing_policy must be cache_aware or load, got {self.routing_policy!r}")
        for name in ("prefix_imbalance_tokens", "max_migrations"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.prefix_index_tokens < 16:
            raise ConfigError(f"prefix_index_tokens must be >= 16, got {self.prefix_index_tokens!r}")
        if not self.served_model_name:
            raise ConfigError("served_model_name must not be empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("TLS needs both tls_cert_file and tls_key_file")
