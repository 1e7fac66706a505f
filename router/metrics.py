"""Prometheus metrics of the router, all prefixed `pdserve_`.

Each router owns its own CollectorRegistry (several routers can live in one test process); `/metrics`
exposes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from pdserve.proto.pdserve_pb2 import PrefillResponse
    from pdserve.router.registry import Worker

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5,
                      1.0, 2.5)
_BYTES_BUCKETS = tuple(float(2 ** k) for k in range(16, 36, 2))  # 64 KiB .. 16 GiB


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdserve_requests", "Finished requests by endpoint and status "
                                "(HTTP status code, or gRPC status name for grpc_generate)",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests being served",
                               ["endpoint"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Arrival at the router to the first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Gap between consecutive output tokens (a chunk of k tokens counts "
                             "k gaps of 1/k of its wait)", buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Arrival to last token (or error)", ["endpoint"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.kv_bytes = Histogram("pdserve_kv_transfer_bytes",
                                  "KV bytes one prefill wrote into a decode worker",
                                  buckets=_BYTES_BUCKETS, registry=r)
        self.kv_seconds = Histogram("pdserve_kv_transfer_seconds",
                                    "Time one prefill spent moving its KV", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.prefill_queue = Histogram("pdserve_prefill_queue_seconds",
                                       "Time a prompt waited in a prefill worker's queue",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_compute = Histogram("pdserve_prefill_compute_seconds",
                                         "Prefill forward time of one prompt",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.retries = Counter("pdserve_retries", "Worker calls retried elsewhere, by stage and "
                               "gRPC status", ["stage", "code"], registry=r)
        self.admission_waiting = Gauge("pdserve_admission_queue_requests",
                                       "Requests waiting at the router for a decode batch slot "
                                       "and KV blocks", registry=r)
        self.admission_wait = Histogram("pdserve_admission_queue_wait_seconds",
                                        "Time a request waited for a decode batch slot and KV "
                                        "blocks (those that waited)", buckets=_LATENCY_BUCKETS,
                                        registry=r)
        self.worker_failures = Counter("pdserve_worker_failures", "Request-path worker failures",
                                       ["role", "worker", "code"], registry=r)
        self.decode_kv_usage = Gauge("pdserve_decode_kv_usage_ratio",
                                     "KV blocks in use over all KV blocks of the routable decode "
                                     "workers (0 with none): the decode pool's load, for "
                                     "autoscaling", registry=r)
        self.prefill_prompt_tokens = Counter(
            "pdserve_prefill_prompt_tokens", "Prompt tokens sent to prefill workers (re-prefills "
            "of migrated streams included)", registry=r)
        self.prefill_cached_tokens = Counter(
            "pdserve_prefill_cached_tokens", "Prompt tokens whose KV a prefill worker's prefix "
            "cache already held (not computed)", registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "pdserve_prefix_cache_hit_rate", "Cached / prompt tokens over all prefills so far",
            registry=r)
        self.migrations = Counter("pdserve_migrations", "Streams whose decode worker failed: "
                                  "continued elsewhere (migrated), ended at the limit (limit) or with no "
                                  "pair to go to (failed)",
                                  ["outcome"], registry=r)
        self._prefix_totals = [0, 0]  # prompt, cached tokens (for the hit-rate gauge)
        worker_labels = ["role", "worker"]
        self.worker_healthy = Gauge("pdserve_worker_healthy", "1 if the worker is routable",
                                    worker_labels, registry=r)
        self.worker_queued = Gauge("pdserve_worker_queued_requests", "Queued requests (LoadReport)",
                                   worker_labels, registry=r)
        self.worker_queued_tokens = Gauge("pdserve_worker_queued_prompt_tokens",
                                          "Queued prompt tokens (LoadReport)", worker_labels,
                                          registry=r)
        self.worker_running = Gauge("pdserve_worker_running_requests",
                                    "Running requests (LoadReport)", worker_labels, registry=r)
        self.kv_blocks_used = Gauge("pdserve_worker_kv_blocks_used", "KV blocks in use (LoadReport)",
                                    worker_labels, registry=r)
        self.kv_blocks_total = Gauge("pdserve_worker_kv_blocks_total", "KV blocks (LoadReport)",
                                     worker_labels, registry=r)
        self.kv_selftest = Gauge("pdserve_worker_kv_selftest_bytes_per_second",
                                 "The worker's start-up KV transfer self-test (kvtransfer/selftest.py): "
                                 "tens of GB/s over RDMA, ~1 GB/s or less over TCP (LoadReport)",
                                 worker_labels, registry=r)
        self._load_gauges = (self.worker_queued, self.worker_queued_tokens, self.worker_running,
                             self.kv_blocks_used, self.kv_blocks_total, self.kv_selftest)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- per worker ------------------------------------------------------------------------
    def observe_worker(self, worker: Worker) -> None:
        """Export the worker's last LoadReport; none while it is out of rotation for failing
        (its last report says nothing of it now), only pdserve_worker_healthy 0."""
        labels = (worker.role, worker.name)
        self.worker_healthy.labels(*labels).set(1 if worker.routable else 0)
        load = worker.load
        if load is None or not worker.breaker.closed:
            self._remove(worker, self._load_gauges)
            return
        self.worker_queued.labels(*labels).set(load.queued_requests)
        self.worker_queued_tokens.labels(*labels).set(load.queued_prompt_tokens)
        self.worker_running.labels(*labels).set(load.running_requests)
        if load.kv_selftest_bytes_per_second:
            self.kv_selftest.labels(*labels).set(load.kv_selftest_bytes_per_second)
        if worker.role == "decode":
            self.kv_blocks_used.labels(*labels).set(load.kv_blocks_used)
            self.kv_blocks_total.labels(*labels).set(load.kv_blocks_total)

    def forget_worker(self, worker: Worker) -> None:
        self._remove(worker, (self.worker_healthy, *self._load_gauges))

    @staticmethod
    def _remove(worker: Worker, gauges) -> None:
        for gauge in gauges:
            try:
                gauge.remove(worker.role, worker.name)
            except KeyError:
                pass

    def worker_failure(self, worker: Worker, code: str) -> None:
        self.worker_failures.labels(worker.role, worker.name, code).inc()
        self.observe_worker(worker)

    # ---- per request -----------------------------------------------------------------------
    def observe_prefill(self, response: PrefillResponse) -> None:
        self.kv_bytes.observe(response.kv_bytes)
        self.kv_seconds.observe(response.kv_transfer_seconds)
        self.prefill_queue.observe(response.queue_seconds)
        self.prefill_compute.observe(response.compute_seconds)

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefill_prompt_tokens.inc(prompt_tokens)
        self.prefill_cached_tokens.inc(cached_tokens)
        self._prefix_totals[0] += prompt_tokens
        self._prefix_totals[1] += cached_tokens
        total, cached = self._prefix_totals
        self.prefix_cache_hit_rate.set(cached / total if total else 0.0)

    def observe_tokens(self, num_tokens: int, wait_seconds: float, *, first: bool) -> None:
        """`num_tokens` arrived after `wait_seconds` (since arrival if `first`, else since the last)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        if first:
            self.ttft.observe(wait_seconds)
        else:
            gap = wait_seconds / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(gap)
