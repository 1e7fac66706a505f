"""gRPC face of a decode worker: Reserve / Decode (token stream) / Cancel / Load / KVMetadata.

Errors leave as status codes: RESOURCE_EXHAUSTED (no KV blocks), INVALID_ARGUMENT, NOT_FOUND
(unknown request), UNAVAILABLE (draining). A Decode stream whose caller goes away cancels the
request, which frees its blocks.
"""

from __future__ import annotations

import logging
import queue

import grpc

from pdserve.engine.kv_cache import KVCacheFull
from pdserve.engine.sampling import SamplingError, SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import logprob_message, sampling_kwargs

from .scheduler import DecodeScheduler, ReservationError

log = logging.getLogger(__name__)

FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


class DecodeService(pb_grpc.DecodeWorkerServicer):
    def __init__(self, scheduler: DecodeScheduler, agent, *, worker_id: str,
                 rank_agents: list[tuple[str, bytes]] | None = None,
                 default_ttl_s: float = 60.0):
        """rank_agents: (agent name, peer-info blob) of every rank of the worker, by rank (default:
        this process's `agent` alone, a one-rank worker)."""
        self.scheduler = scheduler
        self.agent = agent
        self.worker_id = worker_id
        self.rank_agents = list(rank_agents) if rank_agents else [(agent.name, agent.peer_info())]
        self.default_ttl_s = default_ttl_s
        self.draining = False
        self.kv_selftest_bytes_per_second = 0.0  # set at start (--kv-selftest-mib)

    # -- RPCs ---------------------------------------------------------------------------------------
    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        ttl = request.ttl_seconds if request.ttl_seconds > 0 else self.default_ttl_s
        try:
            r = self.scheduler.reserve(request.request_id, request.num_prompt_tokens, request.max_new_tokens, ttl,
                                       n=max(1, request.n))
        except KVCacheFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        cache = self.scheduler.cache
        first, sliding = cache.transfer_targets(r.blocks, request.num_prompt_tokens)
        # every rank holds the same block ids (only rank 0 allocates), each for its own KV heads
        placements = [pb.KVPlacement(
            decode_worker_id=self.worker_id, kv_agent_name=name,
            full_block_ids=r.blocks.full, sliding_block_ids=sliding, sliding_first_page=first,
            page_size=cache.page_size, tp_rank=rank, tp_size=len(self.rank_agents),
        ) for rank, (name, info) in enumerate(self.rank_agents)]
        return pb.ReserveResponse(placements=placements)

    def Decode(self, request: pb.DecodeRequest, context):
        try:
            params = SamplingParams(**sampling_kwargs(request.sampling))
            params.check_vocab(self.scheduler.runner.cfg.vocab_size)
            firsts = list(request.first_token_ids) or [request.first_token_id]
            if request.num_generated != len(request.generated_token_ids):
                raise ValueError(f"num_generated {request.num_generated} but "
                                 f"{len(request.generated_token_ids)} generated_token_ids")
            r = self.scheduler.start(request.request_id, firsts, request.num_prompt_tokens, params,
                                     generated=list(request.generated_token_ids))
        except ReservationError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (ValueError, SamplingError) as e:
            self.scheduler.cancel(request.request_id)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id
        context.add_callback(lambda: self.scheduler.cancel(rid))  # caller gone -> free blocks
        unfinished = params.n  # the stream ends after the last choice's finish (or an error)
        carry = None  # an event of another choice, read while coalescing
        while True:
            try:
                ev, carry = (carry, None) if carry is not None else (r.events.get(timeout=0.5), None)
            except queue.Empty:
                if not context.is_active():
                    self.scheduler.cancel(rid)
                    return
                continue
            tokens, logprobs = list(ev.tokens), list(ev.logprobs)
            while ev.finish_reason is None:  # coalesce what is already there (of the same choice)
                try:
                    nxt = r.events.get_nowait()
                except queue.Empty:
                    break
                if nxt.choice != ev.choice:
                    carry = nxt
                    break
                tokens.extend(nxt.tokens)
                logprobs.extend(nxt.logprobs)
                ev = nxt
            chunk = pb.TokenChunk(token_ids=tokens, logprobs=[logprob_message(lp) for lp in logprobs],
                                  choice=ev.choice)
            if ev.finish_reason is not None:
                chunk.finish_reason = FINISH[ev.finish_reason]
                chunk.error = ev.error
                unfinished -= 1
                yield chunk
                if not unfinished or ev.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
                    return
                continue
            yield chunk

    def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        return pb.CancelResponse(found=self.scheduler.cancel(request.request_id, no_writer=request.no_kv_writer))

    def Load(self, request, context) -> pb.LoadReport:
        s = self.scheduler.load()
        cache = self.scheduler.cache
        return pb.LoadReport(
            worker_id=self.worker_id, role="decode", queued_requests=s["queued"],
            running_requests=s["running"], kv_blocks_total=s["blocks_total"], kv_blocks_used=s["blocks_used"],
            kv_blocks_free=s["blocks_free"], max_batch_size=self.scheduler.max_batch_size,
            page_size=cache.page_size, max_context=self.scheduler.runner.max_context, draining=self.draining,
            kv_selftest_bytes_per_second=self.kv_selftest_bytes_per_second,
            kv_blocks_fenced=s["blocks_fenced"], sliding_window_pages=cache.sliding_window_pages,
        )

    def KVMetadata(self, request, context) -> pb.KVMetadataResponse:
        return pb.KVMetadataResponse(peers=[pb.KVPeerInfo.FromString(m) for _, m in self.rank_agents])

    def in_flight(self) -> int:
        """Requests holding KV blocks (reserved, waiting for their KV, or decoding): a draining
        worker waits for them."""
        return self.scheduler.load()["reserved"]
