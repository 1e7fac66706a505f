"""gRPC face of a prefill worker: Prefill / Cancel / Load.

A caller that goes away (router cancelled, deadline passed) cancels its queued prompt.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError

import grpc

from pdserve.engine.kv_cache import KVCacheFull
from pdserve.engine.model_runner import InvalidRequest
from pdserve.engine.sampling import SamplingError, SamplingParams
from pdserve.kvtransfer import KVTransferError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import logprob_message, sampling_kwargs

from .executor import PlacementError, PrefillExecutor, PrefillJob, QueueFull
from .kv_peers import KVPeerDirectory, UnknownKVPeer

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, executor: PrefillExecutor, *, worker_id: str, peers: KVPeerDirectory | None = None):
        self.executor = executor
        self.peers = peers or KVPeerDirectory()  # decode ranks, learned once per decode worker
        self.worker_id = worker_id
        self.draining = False
        self.kv_selftest_bytes_per_second = 0.0  # set at start (--kv-selftest-mib)

    def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining")
        if not request.placements:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no KV placement given")
        try:
            if not 0 <= request.num_generated < len(request.prompt_token_ids):
                raise ValueError(f"num_generated {request.num_generated} is not within the "
                                 f"{len(request.prompt_token_ids)}-token prompt")
            job = PrefillJob(request.request_id, list(request.prompt_token_ids),
                             SamplingParams(**sampling_kwargs(request.sampling)), list(request.placements),
                             sample_index=request.num_generated)
            remaining = context.time_remaining()
            if remaining is not None:
                job.deadline = time.monotonic() + remaining
            job.peers = self.peers.resolve([p.kv_agent_name for p in request.placements],
                                           request.decode_address)
            future = self.executor.submit(job)
        except UnknownKVPeer as e:  # the decode side is at fault, as when a write fails
            context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {e}")
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InterruptedError as e:
            context.abort(grpc.StatusCode.CANCELLED, str(e))
        except (InvalidRequest, SamplingError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # the RPC ended (answered, or its caller gone): drop the job if it is still there
        context.add_callback(lambda: self.executor.cancel(request.request_id, remember=False))
        timeout = context.time_remaining()
        try:
            r = future.result(timeout=timeout)
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "prefill cancelled")
        except TimeoutError:
            self.executor.cancel(request.request_id)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        except PlacementError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVCacheFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except KVTransferError as e:
            context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {e}")
        except InterruptedError as e:
            context.abort(grpc.StatusCode.CANCELLED, str(e))
        except Exception as e:  # noqa: BLE001 - one failed prompt must not take the worker down
            log.exception("prefill of %s failed", request.request_id)
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
        response = pb.PrefillResponse(request_id=request.request_id, first_token_id=r.first_token,
                                      kv_bytes=r.kv_bytes, kv_transfer_seconds=r.transfer_s,
                                      queue_seconds=r.queue_s, compute_seconds=r.compute_s,
                                      cached_tokens=r.cached_tokens,
                                      prompt_logprobs=[logprob_message(lp) for lp in r.prompt_logprobs])
        if r.first_logprob is not None:
            response.first_token_logprob.CopyFrom(logprob_message(r.first_logprob))
        response.first_token_ids.extend(r.choice_tokens)
        response.first_token_logprobs.extend(logprob_message(lp) for lp in r.choice_logprobs if lp is not None)
        return response

    def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        return pb.CancelResponse(found=self.executor.cancel(request.request_id))

    def in_flight(self) -> int:
        """Prompts queued or running: a draining worker waits for them."""
        return self.executor.load()["queued"]

    def Load(self, request, context) -> pb.LoadReport:
        s = self.executor.load()
        cache = self.executor.runner.cache
        idle_cached = self.executor.prefix_cache.num_evictable_blocks  # reusable at once: not "used"
        return pb.LoadReport(
            worker_id=self.worker_id, role="prefill", queued_requests=s["queued"],
            queued_prompt_tokens=s["queued_tokens"], kv_blocks_total=cache.num_total_blocks,
            kv_blocks_used=cache.num_used_blocks - idle_cached,
            kv_blocks_free=cache.num_free_blocks + idle_cached,
            page_size=cache.page_size, max_context=self.executor.runner.max_context, draining=self.draining,
            kv_selftest_bytes_per_second=self.kv_selftest_bytes_per_second,
            sliding_window_pages=cache.sliding_window_pages,
        )
