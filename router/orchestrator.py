"""One request's way through the workers: Reserve (decode) -> Prefill -> Decode stream.

Retries happen only on retryable statuses: a decode worker that is full or gone is skipped for the
next-ranked one; a prefill worker that is full, dying or gone is retried on another prefill worker
after a jittered backoff, reusing the same KV reservation; a prefill that answers ABORTED (its KV
could not reach the decode worker) blames the decode worker and the request starts over on
another. A decode worker that dies or drops a stream mid-way is taken out of rotation and the
stream migrates (up to `max_migrations` times): prompt + the tokens already streamed are
re-prefilled on another pair (mostly from the prefill worker's prefix cache) and decoding goes on
from the next token, with the same seed and token index, so the caller sees one stream with no
token repeated or skipped. Whatever ends a request early (client
gone, stop string, error, timeout) sends Cancel to both workers so the KV blocks are freed.
Every RPC carries a deadline; one request id is used on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import AsyncIterator

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.router.admission import AdmissionQueue, Place
from pdserve.router.config import RouterConfig
from pdserve.router.errors import (InvalidRequestError, NoHealthyWorkersError, OverloadedError,
                           RequestTimeoutError, RouterError, UpstreamError)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import RoutingPolicy, kv_blocks_for_choices, max_new_tokens_within
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.router.retry import WORKER_DIED, WORKER_FULL, WORKER_GONE, backoff_delay

log = logging.getLogger(__name__)

FINISH_STOP = pdserve_pb2.FINISH_REASON_STOP
FINISH_LENGTH = pdserve_pb2.FINISH_REASON_LENGTH
FINISH_CANCELLED = pdserve_pb2.FINISH_REASON_CANCELLED
FINISH_ERROR = pdserve_pb2.FINISH_REASON_ERROR


@dataclasses.dataclass(slots=True)
class TokenEvent:
    """New token ids; `finish_reason` (a pdserve_pb2.FinishReason) is non-zero on the last event;
    `logprobs` (pdserve_pb2.TokenLogprob, one per id) when the sampling parameters asked for them."""

    token_ids: list[int]
    finish_reason: int = 0
    logprobs: list = dataclasses.field(default_factory=list)
    choice: int = 0  # sampling.n > 1: which choice; `finish_reason` then ends that choice only


class ChoiceSplitter:
    """One generation's events (its first one already taken) as one stream per choice, each ending
    with its choice's finish. A pump task reads the generation while any choice stream is read; an
    error reaches every stream; the generation's stream closes once every choice stream has."""

    def __init__(self, first: TokenEvent | None, events: AsyncIterator[TokenEvent], num_choices: int) -> None:
        self._events = events
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(num_choices)]
        self._pump_task: asyncio.Task | None = None
        self._open = num_choices
        if first is None:  # the client left before the first token
            for queue in self._queues:
                queue.put_nowait(None)
        else:
            self._queues[first.choice].put_nowait(first)

    async def _pump(self) -> None:
        try:
            async for event in self._events:
                self._queues[event.choice].put_nowait(event)
            end: object = None
        except BaseException as error:  # noqa: BLE001 - handed to every choice
            end = error
        for queue in self._queues:
            queue.put_nowait(end)

    async def stream(self, choice: int) -> AsyncIterator[TokenEvent]:
        if self._pump_task is None:
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        try:
            while True:
                item = await self._queues[choice].get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason:
                    return
        finally:
            self._open -= 1
            if not self._open:
                self._pump_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._events.aclose()


class _KVDestinationFailed(Exception):
    """Prefill said ABORTED: writing the KV into the reserved decode blocks failed."""


class _NoRoom(Exception):
    """No decode worker has room (a batch slot and KV blocks) for the request now (estimate,
    or every Reserve refused)."""


class _DecodeLost(Exception):
    """The decode worker died or dropped the stream; `error` ends the stream unless it migrates."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


def _finish_name(finish_reason: int) -> str:
    return pdserve_pb2.FinishReason.Name(finish_reason)


def _rpc_reason(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"


class Orchestrator:
    """Admits requests and creates `Generation`s; owns the fire-and-forget Cancel calls."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, policy: RoutingPolicy,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()
        self.admission = AdmissionQueue(config.max_queued_requests, config.overload_retry_after,
                                        metrics)
        registry.add_listener(self.admission.wake)  # a load report may show room again

    def admit(self, num_prompt_tokens: int, max_tokens: int | None, *, param: str, n: int = 1) -> int:
        """Check the request against the pools and the context limit; return max_new_tokens.

        `max_tokens=None` means "as many as fit": the default, capped by the context left after
        the prompt and by the largest decode worker's KV pool. An explicit `max_tokens` that does
        not fit is the client's error (400), as is a prompt that alone fills the context, or `n`
        choices that no decode worker's KV pool could ever hold. `param` names the prompt field
        in errors.
        """
        for role in ("prefill", "decode"):
            if not self.registry.routable(role):
                total = len(self.registry.workers(role))
                raise NoHealthyWorkersError(
                    f"No healthy {role} worker is available ({total} known, 0 routable); "
                    "retry later.", code="no_healthy_workers",
                    retry_after=self.config.unavailable_retry_after)
        if num_prompt_tokens <= 0:
            raise InvalidRequestError("The prompt is empty.", param=param)
        max_context = self.registry.max_context()
        if max_tokens is not None and max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}.",
                                      param="max_tokens")
        if not max_context:
            max_new = max_tokens if max_tokens is not None else self.config.default_max_tokens
            return self._within_kv_pools(num_prompt_tokens, max_new, n, max_tokens is None, param)
        if num_prompt_tokens >= max_context:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_context} tokens. However, your "
                f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
                param=param, code="context_length_exceeded")
        room = max_context - num_prompt_tokens
        if max_tokens is None:
            return self._within_kv_pools(num_prompt_tokens, min(self.config.default_max_tokens, room),
                                         n, True, param)
        if max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_context} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return self._within_kv_pools(num_prompt_tokens, max_tokens, n, False, param)

    def _within_kv_pools(self, num_prompt_tokens: int, max_new: int, n: int, default: bool,
                         param: str) -> int:
        """`max_new`, if its `n` choices fit the KV pool of the largest decode worker discovery
        lists (else they would wait for room that never comes, then get a 429); a default
        `max_new` is cut to what fits; else a 400 naming `n` (one choice would fit), `max_tokens`,
        or the prompt. No check while a decode worker does not report its pool."""
        pools = [(w.load.kv_blocks_total, w.load.page_size, w.load.sliding_window_pages)
                 for w in self.registry.workers("decode") if w.load is not None]
        if not pools or any(blocks <= 0 or page <= 0 for blocks, page, _ in pools):
            return max_new

        def fits(choices: int) -> int:
            return max(max_new_tokens_within(num_prompt_tokens, choices, blocks, page, window)
                       for blocks, page, window in pools)

        room = fits(n)
        if max_new <= room:
            return max_new
        if default and room >= 1:
            return room
        blocks, page, window = max(pools, key=lambda pool: pool[0] * pool[1])
        pool = f"the largest decode worker's KV cache holds {blocks} blocks of {page} tokens"
        if window:
            pool += (f" (a request takes one for each page of its full-attention layers and up to {window} for "
                     "its sliding-window layers)")
        wanted = 1 if default else max_new
        if n > 1 and wanted <= fits(1):
            need = kv_blocks_for_choices(num_prompt_tokens, wanted, n, page, window)
            raise InvalidRequestError(
                f"{n} choices of {num_prompt_tokens} prompt + {wanted} completion tokens need "
                f"{need} blocks of KV cache, but {pool}. Reduce n or max_tokens.",
                param="n", code="invalid_value")
        if default:
            raise InvalidRequestError(
                f"The prompt has {num_prompt_tokens} tokens, leaving no room for a completion: "
                f"{pool}.", param=param, code="context_length_exceeded")
        raise InvalidRequestError(
            f"You requested {num_prompt_tokens + max_new} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_new} for the completion), but {pool}. Reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 sampling: pdserve_pb2.SamplingParams, *, arrival: float | None = None) -> "Generation":
        """A request ready to run; iterate `generation.events()` to run it.

        `arrival` is the event-loop time the request reached the router (TTFT and the request
        deadline count from it).
        """
        loop = asyncio.get_running_loop()
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        return Generation(self, request_id, list(prompt_token_ids), sampling,
                          loop.time() if arrival is None else arrival)

    def send_cancel(self, worker: Worker, request_id: str, *, no_kv_writer: bool = False) -> None:
        """Best-effort Cancel on `worker`, in the background (callers may be unwinding).
        `no_kv_writer`: no prefill worker was given this reservation (its blocks need no fence)."""
        async def cancel() -> None:
            try:
                await worker.stub.Cancel(pdserve_pb2.CancelRequest(request_id=request_id,
                                                                   no_kv_writer=no_kv_writer),
                                         timeout=self.config.cancel_timeout)
            except grpc.aio.AioRpcError as error:
                log.debug("Cancel %s on %s failed: %s", request_id, worker.name, _rpc_reason(error))

        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for outstanding Cancel calls (shutdown)."""
        await asyncio.gather(*list(self._background), return_exceptions=True)


class Generation:
    """One request: picks and reserves a decode worker, prefills, then streams decode tokens.

    Use `async with contextlib.aclosing(gen.events()) as events`; the first event carries the
    first token (from prefill). Errors before the first event are `RouterError`s the caller can
    turn into a status code; later ones end the stream (`UpstreamError`, `RequestTimeoutError`).
    `cancel()` (client gone) stops it from any task; `events()` then simply ends.
    """

    def __init__(self, orchestrator: Orchestrator, request_id: str, prompt_token_ids: list[int],
                 sampling: pdserve_pb2.SamplingParams, arrival: float) -> None:
        self._orch = orchestrator
        self._config = orchestrator.config
        self._metrics = orchestrator.metrics
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.arrival = arrival
        self.deadline = arrival + self._config.request_timeout
        self.decode_worker: Worker | None = None
        self.prefill_worker: Worker | None = None
        self.placements: list[pdserve_pb2.KVPlacement] = []
        self.prompt_logprobs: list[pdserve_pb2.TokenLogprob] = []  # from the prefill, when asked
        self._call: grpc.aio.Call | None = None
        self._aborted = asyncio.Event()
        self._finished = False
        self._released = False
        self._kv_blocks = 0  # the router's estimate of what the reservation holds
        self._holds_slot = False  # counted in decode_worker.active_requests
        self._held: Worker | None = None  # the decode worker kept connected for this request
        self._queue_place: Place | None = None  # while waiting for room
        self.generated: list[int] = []  # tokens streamed to the caller so far
        self._prefilled_generated = 0  # of those, how many the current prefill's prompt holds
        self.cached_tokens = 0  # prompt tokens the (first) prefill found in its prefix cache
        self.migrations = 0

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    @property
    def num_choices(self) -> int:
        return max(1, self.sampling.n)

    def cancel(self, reason: str) -> None:
        """Stop the request now (client gone, stop string hit); Cancel goes to both workers.

        Safe from any task on the loop, and idempotent; `events()` then ends without a finish.
        """
        if self._aborted.is_set() or self._finished or self._released:
            return
        log.info("request %s cancelled: %s", self.request_id, reason)
        self._aborted.set()
        if self._queue_place is not None:
            self._queue_place.turn.cancel()
        self._release()

    async def events(self) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        try:
            response = await self._admit(set())
            if response is None:
                return
            self.cached_tokens = response.cached_tokens
            last = loop.time()
            self._metrics.observe_tokens(1, last - self.arrival, first=True)
            self.prompt_logprobs = list(response.prompt_logprobs)
            if self.num_choices > 1:  # one prefill sampled every choice's first token
                firsts = list(response.first_token_ids)
                for i, token in enumerate(firsts):
                    logprobs = [response.first_token_logprobs[i]] if response.first_token_logprobs else []
                    yield TokenEvent([token], logprobs=logprobs, choice=i)
                try:
                    async for event in self._decode(firsts, last):
                        yield event
                except _DecodeLost as lost:  # n choices share one decode: they do not migrate
                    raise lost.error from None
                return
            while True:
                self.generated.append(response.first_token_id)
                first_logprobs = ([response.first_token_logprob]
                                  if response.HasField("first_token_logprob") else [])
                yield TokenEvent([response.first_token_id], logprobs=first_logprobs)
                try:
                    async for event in self._decode([response.first_token_id], last):
                        self.generated.extend(event.token_ids)
                        yield event
                    return
                except _DecodeLost as lost:
                    response = await self._migrate(lost)
                if response is None:
                    return
                now = loop.time()
                self._metrics.observe_tokens(1, now - last, first=False)
                last = now
        finally:
            if not self._finished:
                self._release()
            self._unhold()

    def _prompt(self) -> list[int]:
        """What a prefill runs now: the prompt, then the tokens already streamed (migration)."""
        return self.prompt_token_ids + self.generated

    async def _migrate(self, lost: _DecodeLost) -> pdserve_pb2.PrefillResponse | None:
        """Re-prefill prompt + streamed tokens on another pair and continue the same stream (its
        seed and token index carry over); the stream's error when over the migration limit."""
        if self.aborted:
            return None
        if self.migrations >= self._config.max_migrations:
            self._metrics.migrations.labels("limit").inc()
            raise lost.error
        self.migrations += 1
        old = self.decode_worker
        log.warning("request %s: %s; migrating after %d tokens (%d/%d)", self.request_id,
                    lost.error.message, len(self.generated), self.migrations,
                    self._config.max_migrations)
        self._orch.send_cancel(old, self.request_id)
        self._give_back_blocks()
        self._unhold()
        self.decode_worker, self._call = None, None
        try:
            response = await self._admit({old.endpoint.address})
        except RouterError as error:  # nowhere to go: the stream ends with what broke it
            log.warning("request %s could not migrate: %s", self.request_id, error.message)
            self._metrics.migrations.labels("failed").inc()
            raise lost.error from None
        if response is not None:
            self._metrics.migrations.labels("migrated").inc()
        return response

    # ---- steps ----------------------------------------------------------------------------
    def _remaining(self) -> float:
        remaining = self.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise RequestTimeoutError(
                f"Request {self.request_id} exceeded the router's request timeout of "
                f"{self._config.request_timeout:g}s.", code="timeout")
        return remaining

    async def _admit(self, broken_decode: set[str]) -> pdserve_pb2.PrefillResponse | None:
        """Reserve on a decode worker (not one in `broken_decode`), then prefill into it; None if
        cancelled meanwhile.

        A prefill that fails because the KV could not reach the decode worker (ABORTED) blames
        that decode worker: its reservation is cancelled and the request starts over elsewhere.
        """
        broken_decode = set(broken_decode)
        for _ in range(self._config.max_decode_attempts):
            if self.aborted or not await self._reserve(broken_decode):
                return None
            try:
                response = await self._prefill()
                if response is not None:
                    self._metrics.observe_prefill(response)
                return response
            except _KVDestinationFailed as failure:
                worker = self.decode_worker
                broken_decode.add(worker.endpoint.address)
                self._orch.registry.report_failure(worker, f"kv write {failure}", fatal=True)
                self._orch.send_cancel(worker, self.request_id)
                self._metrics.retries.labels("kv_transfer", "ABORTED").inc()
                self._give_back_blocks()
                self._unhold()
                self.decode_worker = None
        raise NoHealthyWorkersError(
            f"KV transfer to {len(broken_decode)} decode worker(s) failed; retry later.",
            code="kv_transfer_failed", retry_after=self._config.unavailable_retry_after)

    async def _reserve(self, exclude: set[str]) -> bool:
        """Reserve KV blocks on a decode worker, waiting in the admission queue while none has
        room (behind those already waiting); False if cancelled meanwhile."""
        admission = self._orch.admission
        loop = asyncio.get_running_loop()
        place, queued_at = None, None
        try:
            if admission.waiting:
                queued_at = loop.time()
                place = admission.enter()
                if not await self._wait_for_room(place, queued_at):
                    return False
            while True:
                try:
                    reserved = await self._try_reserve(exclude)
                except _NoRoom as no_room:
                    if place is None:
                        queued_at = loop.time()
                        place = admission.enter()
                    else:
                        admission.wait_again(place)  # it was this one's turn: it keeps its place
                    if not await self._wait_for_room(place, queued_at, reason=str(no_room)):
                        return False
                    continue
                if queued_at is not None:
                    self._metrics.admission_wait.observe(loop.time() - queued_at)
                return reserved
        finally:
            if place is not None:
                admission.leave(place)  # placed, failed or cancelled in its turn: the next one's turn

    async def _wait_for_room(self, place: Place, queued_at: float, *, reason: str = "") -> bool:
        """Wait in `place` for this request's turn to try again; False if cancelled meanwhile.

        Refused (429) when the wait would exceed `max_queue_wait`; a request deadline that comes
        first is a timeout (504).
        """
        loop = asyncio.get_running_loop()
        give_up = queued_at + self._config.max_queue_wait
        timeout = min(give_up, self.deadline) - loop.time()
        if timeout <= 0:
            self._raise_wait_exceeded(give_up, reason)
        self._queue_place = place
        try:
            await asyncio.wait_for(place.turn, timeout)
            return not self.aborted
        except asyncio.TimeoutError:
            self._raise_wait_exceeded(give_up, reason)
        except asyncio.CancelledError:
            if self.aborted:
                return False
            raise
        finally:
            self._queue_place = None

    def _raise_wait_exceeded(self, give_up: float, reason: str) -> None:
        if give_up <= self.deadline:
            raise OverloadedError(
                f"No decode worker had room (batch slot and KV blocks) for this request within "
                f"{self._config.max_queue_wait:g}s ({reason or 'others waited first'}); "
                "retry later.", code="kv_cache_full", retry_after=self._config.overload_retry_after)
        raise RequestTimeoutError(f"Request {self.request_id} timed out waiting for decode room.",
                                  code="timeout")

    async def _try_reserve(self, exclude: set[str]) -> bool:
        """Reserve KV blocks on the best decode worker that accepts; False if cancelled.

        Raises `_NoRoom` when none has room now."""
        registry, policy = self._orch.registry, self._orch.policy
        num_prompt = len(self.prompt_token_ids) + len(self.generated)
        max_new = self.sampling.max_new_tokens - len(self.generated)
        alive = [w for w in registry.routable("decode") if w.endpoint.address not in exclude]
        candidates = policy.rank_decode(alive, num_prompt, max_new)
        if alive and not candidates:
            raise _NoRoom(f"no decode worker has a free batch slot and KV blocks for "
                          f"{num_prompt + max_new} tokens")
        full = 0
        for worker in candidates:
            remaining = self._remaining()
            timeout = min(self._config.reserve_timeout, remaining)
            request = pdserve_pb2.ReserveRequest(
                request_id=self.request_id, num_prompt_tokens=num_prompt, max_new_tokens=max_new,
                ttl_seconds=remaining, n=self.sampling.n)
            # counted on the worker now, not when Reserve returns: the next request of a burst
            # must already see it; choices after the first add their own pages (and a copy of
            # the prompt's last, partial one)
            load = worker.load or pdserve_pb2.LoadReport()
            blocks = kv_blocks_for_choices(num_prompt, max_new, self.num_choices, load.page_size,
                                           load.sliding_window_pages)
            placed = worker.pending_kv.add(blocks)
            worker.active_requests += 1
            call = worker.stub.Reserve(request, timeout=timeout)
            self._call = call
            try:
                response = await call
            except asyncio.CancelledError:
                worker.pending_kv.withdraw(placed)
                worker.active_requests -= 1
                if self.aborted:
                    return False
                raise
            except grpc.aio.AioRpcError as error:
                worker.pending_kv.withdraw(placed)
                worker.active_requests -= 1
                if self.aborted:
                    return False
                code = error.code()
                if code in WORKER_FULL:
                    full += 1
                    self._metrics.retries.labels("reserve", code.name).inc()
                    continue
                if code is grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(f"Decode worker rejected the request: "
                                              f"{error.details()}") from None
                if code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout >= remaining:
                    raise RequestTimeoutError(f"Request {self.request_id} timed out waiting for "
                                              "a KV reservation.", code="timeout") from None
                # gone, dying or too slow: it may hold a reservation we never heard of
                registry.report_failure(worker, f"reserve {_rpc_reason(error)}",
                                        fatal=code in WORKER_DIED)
                self._orch.send_cancel(worker, self.request_id, no_kv_writer=True)
                self._metrics.retries.labels("reserve", code.name).inc()
                continue
            worker.pending_kv.confirm(placed)
            registry.hold(worker)  # until the stream ends, even if the worker starts draining
            self._held = worker
            self.decode_worker = worker
            self._kv_blocks = blocks
            self._holds_slot = True
            if self.aborted:  # client left while the reservation was in flight
                self._release()
                return False
            self.placements = list(response.placements)
            return True
        if full:
            raise _NoRoom(f"all {full} decode workers refused: out of KV blocks")
        raise NoHealthyWorkersError("No decode worker could be reached; retry later.",
                                    code="no_healthy_workers",
                                    retry_after=self._config.unavailable_retry_after)

    async def _prefill(self) -> pdserve_pb2.PrefillResponse | None:
        """Run the prompt on a prefill worker, retrying elsewhere; None if aborted."""
        registry, policy = self._orch.registry, self._orch.policy
        prompt = self._prompt()
        self._prefilled_generated = len(self.generated)
        request = pdserve_pb2.PrefillRequest(
            request_id=self.request_id, prompt_token_ids=prompt, sampling=self.sampling,
            placements=self.placements, num_generated=len(self.generated),
            decode_address=self.decode_worker.endpoint.address)
        tried: set[str] = set()
        full = gone = 0
        last_error = ""
        for attempt in range(self._config.max_prefill_attempts):
            candidates = [w for w in policy.rank_prefill(registry.routable("prefill"), len(prompt),
                                                         prompt)
                          if w.endpoint.address not in tried]
            if not candidates:
                break
            worker = candidates[0]
            tried.add(worker.endpoint.address)
            self.prefill_worker = worker
            queued = worker.pending_prompt.add(len(prompt))  # until it answers
            call = worker.stub.Prefill(request, timeout=self._remaining())
            self._call = call
            try:
                response = await call
                policy.prefilled(worker, prompt)
                self._metrics.observe_prefix(len(prompt), response.cached_tokens)
                return response
            except asyncio.CancelledError:
                if self.aborted:
                    return None
                raise
            except grpc.aio.AioRpcError as error:
                if self.aborted:
                    return None
                code = error.code()
                last_error = f"{worker.name}: {_rpc_reason(error)}"
                if code is grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(f"Prefill worker rejected the prompt: "
                                              f"{error.details()}") from None
                if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RequestTimeoutError(f"Request {self.request_id} timed out in prefill.",
                                              code="timeout") from None
                if code is grpc.StatusCode.ABORTED:  # the KV could not reach the decode worker
                    raise _KVDestinationFailed(_rpc_reason(error)) from None
                if code not in WORKER_FULL and code not in WORKER_GONE and code not in WORKER_DIED:
                    raise UpstreamError(f"Prefill failed on {last_error}") from None
                self._metrics.retries.labels("prefill", code.name).inc()
                if code in WORKER_FULL:
                    full += 1
                    continue
                gone += 1
                policy.forget(worker)
                registry.report_failure(worker, f"prefill {_rpc_reason(error)}", fatal=True)
                self._orch.send_cancel(worker, self.request_id)  # stop a zombie writing our KV
                delay = backoff_delay(attempt, self._config.retry_base_delay,
                                      self._config.retry_max_delay)
                try:
                    await asyncio.wait_for(self._aborted.wait(), min(delay, self._remaining()))
                    return None
                except asyncio.TimeoutError:
                    pass
            finally:
                worker.pending_prompt.withdraw(queued)
        if full and not gone:
            raise OverloadedError("Every prefill queue is full; retry later.", code="queue_full",
                                  retry_after=self._config.overload_retry_after)
        if not tried:
            raise NoHealthyWorkersError("No healthy prefill worker is available; retry later.",
                                        code="no_healthy_workers",
                                        retry_after=self._config.unavailable_retry_after)
        raise NoHealthyWorkersError(f"Prefill failed on {len(tried)} worker(s); last: {last_error}",
                                    code="prefill_failed",
                                    retry_after=self._config.unavailable_retry_after)

    async def _decode(self, first_token_ids: list[int], last: float) -> AsyncIterator[TokenEvent]:
        worker = self.decode_worker
        loop = asyncio.get_running_loop()
        done = self._prefilled_generated
        request = pdserve_pb2.DecodeRequest(
            request_id=self.request_id, first_token_id=first_token_ids[0],
            num_prompt_tokens=len(self.prompt_token_ids) + done, generated_token_ids=self.generated[:done],
            sampling=self.sampling,
            first_token_ids=first_token_ids if self.num_choices > 1 else [], num_generated=done)
        unfinished = self.num_choices
        call = worker.stub.Decode(request, timeout=self._remaining())
        self._call = call
        try:
            async for chunk in call:
                now = loop.time()
                self._metrics.observe_tokens(len(chunk.token_ids), now - last, first=False)
                last = now
                if chunk.finish_reason in (FINISH_ERROR, FINISH_CANCELLED):
                    if self.aborted:
                        return
                    raise _DecodeLost(UpstreamError(
                        f"Decode worker {worker.name} ended the request: "
                        f"{chunk.error or _finish_name(chunk.finish_reason)}", code="decode_failed"))
                unfinished -= bool(chunk.finish_reason)
                if not unfinished:
                    self._finished = True
                    self._give_back_blocks()
                yield TokenEvent(list(chunk.token_ids), chunk.finish_reason, list(chunk.logprobs), chunk.choice)
                if self._finished:
                    return
        except asyncio.CancelledError:
            if self.aborted:
                return
            raise
        except grpc.aio.AioRpcError as error:
            if self.aborted:
                return
            failure = self._decode_failure(worker, error)
            if error.code() in WORKER_DIED or error.code() in WORKER_GONE:
                raise _DecodeLost(failure) from None
            raise failure from None
        if not self.aborted:
            raise _DecodeLost(UpstreamError(f"Decode worker {worker.name} closed the stream "
                                            "without a finish reason.", code="decode_failed"))

    def _decode_failure(self, worker: Worker, error: grpc.aio.AioRpcError) -> RouterError:
        code = error.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestTimeoutError(f"Request {self.request_id} exceeded the router's request "
                                       f"timeout of {self._config.request_timeout:g}s.",
                                       code="timeout")
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequestError(f"Decode worker rejected the request: {error.details()}")
        self._orch.registry.report_failure(worker, f"decode {_rpc_reason(error)}",
                                           fatal=code in WORKER_DIED)
        return UpstreamError(f"Decode worker {worker.name} failed mid-stream: "
                             f"{_rpc_reason(error)}", code="decode_failed")

    def _release(self) -> None:
        """Free what the request holds: cancel the RPC in flight, Cancel on both workers."""
        if self._released:
            return
        self._released = True
        if self._call is not None and not self._call.done():
            self._call.cancel()
        if self.decode_worker is not None:
            self._orch.send_cancel(self.decode_worker, self.request_id,
                                   no_kv_writer=self.prefill_worker is None)
        if self.prefill_worker is not None:
            self._orch.send_cancel(self.prefill_worker, self.request_id)
        self._give_back_blocks()

    def _unhold(self) -> None:
        if self._held is not None:
            self._orch.registry.unhold(self._held)
            self._held = None

    def _give_back_blocks(self) -> None:
        """The reservation ends (finish or Cancel): its blocks and batch slot count as free again
        at once, and the longest waiter for room tries again."""
        worker = self.decode_worker
        if worker is None or not self._holds_slot:
            return
        self._holds_slot = False
        worker.active_requests -= 1
        if self._kv_blocks:
            worker.pending_kv.confirm(worker.pending_kv.add(-self._kv_blocks))
            self._kv_blocks = 0
        self._orch.admission.wake()
