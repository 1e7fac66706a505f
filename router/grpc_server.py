"""Public gRPC API: `pdserve.v1.Generator/Generate` (token ids in, streamed ids out) + health.

For internal callers that bring their own tokenization. Errors before the first token are gRPC
statuses (with a `retry-after` trailer for RESOURCE_EXHAUSTED / UNAVAILABLE); errors after it end
the stream with FINISH_REASON_ERROR and `error`, as the contract says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router import structured_output
from pdserve.router.config import RouterConfig
from pdserve.router.errors import ConflictError, InvalidRequestError, ModelNotFoundError, RouterError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_schema import MAX_CHOICES
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.registry import WorkerRegistry
from pdserve.router.request_limits import REQUEST_ID

log = logging.getLogger(__name__)

ENDPOINT = "grpc_generate"
SERVICE_NAME = pdserve_pb2.DESCRIPTOR.services_by_name["Generator"].full_name


class GeneratorService(pdserve_pb2_grpc.GeneratorServicer):
    def __init__(self, config: RouterConfig, orchestrator: Orchestrator, metrics: RouterMetrics,
                 vocab_size: int) -> None:
        self.config = config
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.vocab_size = vocab_size
        self._request_ids: set[str] = set()  # caller ids of the Generate calls in flight

    async def Generate(self, request: pdserve_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """Streams with `context.write`, not as an async generator: a client's cancel then lands
        in this coroutine, whose `aclosing` closes the event stream at once (its finally sends
        Cancel to the workers), instead of whenever the garbage collector finds the generator."""
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        self.metrics.in_flight.labels(ENDPOINT).inc()
        status = grpc.StatusCode.CANCELLED  # unless we get to the end
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        sent_any = False
        holds_id = False
        try:
            if request_id in self._request_ids:
                # the workers key a request's reservation, KV and Cancel by its id: a second one
                # would be refused by the decode worker, and its Cancel would end the first
                raise ConflictError(f"request_id {request_id!r} is in flight already", param="request_id")
            self._request_ids.add(request_id)
            holds_id = True
            sampling = self._validate(request)
            sampling.max_new_tokens = self.orchestrator.admit(
                len(request.prompt_token_ids), sampling.max_new_tokens or None,
                param="prompt_token_ids", n=max(1, sampling.n))
            generation = self.orchestrator.generate(request_id, list(request.prompt_token_ids),
                                                    sampling, arrival=arrival)
            completion_tokens = 0
            prompt_tokens = len(request.prompt_token_ids)
            async with contextlib.aclosing(generation.events()) as events:
                async for event in events:
                    completion_tokens += len(event.token_ids)
                    sent_any = True
                    await context.write(pdserve_pb2.GenerateResponse(
                        request_id=request_id, token_ids=event.token_ids,
                        finish_reason=event.finish_reason, prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens, logprobs=event.logprobs, choice=event.choice))
                    if event.finish_reason:
                        status = grpc.StatusCode.OK
        except RouterError as error:
            status = error.grpc_code
            if not sent_any:
                metadata = (("retry-after", str(error.retry_after)),) if error.retry_after else ()
                await context.abort(error.grpc_code, error.message, trailing_metadata=metadata)
            log.warning("Generate %s failed mid-stream: %s", request_id, error.message)
            await context.write(pdserve_pb2.GenerateResponse(
                request_id=request_id, finish_reason=pdserve_pb2.FINISH_REASON_ERROR,
                error=error.message))
        finally:
            if holds_id:
                self._request_ids.discard(request_id)
            self.metrics.in_flight.labels(ENDPOINT).dec()
            self.metrics.requests.labels(ENDPOINT, status.name).inc()
            self.metrics.e2e.labels(ENDPOINT).observe(loop.time() - arrival)

    def _validate(self, request: pdserve_pb2.GenerateRequest) -> pdserve_pb2.SamplingParams:
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise InvalidRequestError("request_id must be 1-128 characters of A-Z a-z 0-9 . _ : / + = -",
                                      param="request_id")
        if request.model and request.model != self.config.served_model_name:
            raise ModelNotFoundError(request.model, self.config.served_model_name)
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt_token_ids outside [0, {self.vocab_size}): {bad[:5]}",
                                      param="prompt_token_ids")
        sampling = pdserve_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if sampling.max_new_tokens < 0:
            raise InvalidRequestError("sampling.max_new_tokens must be >= 0 (0 = the default)",
                                      param="sampling.max_new_tokens")
        if not 0 <= sampling.temperature <= 2:
            raise InvalidRequestError("sampling.temperature must be in [0, 2]",
                                      param="sampling.temperature")
        if not 0 <= sampling.top_p <= 1:
            raise InvalidRequestError("sampling.top_p must be in [0, 1]", param="sampling.top_p")
        if sampling.top_k < 0:
            raise InvalidRequestError("sampling.top_k must be >= 0", param="sampling.top_k")
        if sampling.grammar:  # structured output: an llguidance grammar over the generated ids
            structured_output.check(sampling.grammar, "sampling.grammar")
        if not 0 <= sampling.n <= MAX_CHOICES:
            raise InvalidRequestError(f"sampling.n must be in [0, {MAX_CHOICES}] (0 = 1)", param="sampling.n")
        return sampling


class HealthReporter:
    """Keeps the router's grpc.health.v1 status in step with the registry (SERVING when ready)."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.servicer = health_aio.HealthServicer()
        self._registry = registry
        self._serving: bool | None = None
        self._shutting_down = False
        self._pending: set[asyncio.Task] = set()
        registry.add_listener(self.update)

    def update(self) -> None:
        serving = self._registry.ready() and not self._shutting_down
        if serving == self._serving:
            return
        self._serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(self.servicer.set(service, status))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def shutting_down(self) -> None:
        self._shutting_down = True
        self.update()


def create_grpc_server(service: GeneratorService, health: HealthReporter,
                       interceptors: list[grpc.aio.ServerInterceptor] | None = None) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors or None)
    pdserve_pb2_grpc.add_GeneratorServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    return server
