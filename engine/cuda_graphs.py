"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

Why: an eager decode step launches a few hundred kernels from Python (per layer: norms, QKV,
RoPE, KV write, attention, output projection, router, the MoE kernels, all-reduces); at small
batches the host sets the pace (28.6 ms per step at batch 1 for the 24-layer 20b shape on an
H200, about 25x the time the GPU needs to read the weights once). A graph replays the whole step,
embedding to logits, with one launch.

How: a batch of n requests runs in the graph captured for the smallest size >= n. The rows past
n are dummy one-token requests at position 0 that write and read a pad block reserved in each KV
pool when this object is built, so they touch no request's KV. Before each replay the host fills
the static inputs (token ids, positions, KV slots: one pinned staging buffer, which one kernel
copies in, kernels/step_io.py) and plans each attention backend from the padded batch; the
backends are FlashInfer graph-mode objects whose page tables live in fixed device buffers. Every rank of a multi-rank worker executes the same
plans, so all ranks capture and replay the same sizes in lockstep (NCCL collectives are captured
with the graph).

Multi-rank (NCCL) capture, and what could make it hang, each ruled out here:
- a communicator created lazily inside the capture, or warm-up collectives the NCCL watchdog still
  polls when the capture starts: one all-reduce on the current stream and a device sync come first;
- ranks capturing different sizes or in another order (their collectives then pair with the
  wrong peers and wait forever): sizes are agreed across ranks before any capture, all of them
  are captured up front (largest first) and a size that was not cannot be captured later, when
  another rank would not;
- a failure (out of memory, a host sync inside the capture) on one rank while the other goes on
  into the next collective: after each size the ranks agree that all succeeded, or all raise;
- another thread's CUDA calls (NCCL's watchdog, NIXL's progress thread) invalidating a global-mode
  capture: multi-rank steps are captured in thread-local mode.
The graph's collectives are launched on the capture stream, where ProcessGroupNCCL joins its own
stream by events, and replayed on the current stream, as eager steps are.

`capture=False` runs the same padded static-buffer step eagerly, with any attention backend: the
CPU tests use it to check the padding against the plain decode path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pdserve.kernels.paged_batch import PagedBatch
from pdserve.kernels import step_io
from pdserve.kernels.step_io import mapped, stage_step, zero_copy

from .kv_cache import PagedKVCache, cdiv
from .model import GptOssModel, StepContext

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself).
    Padding costs little at decode (the weights are read once whatever the batch)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch}
    sizes.update(range(16, max_batch + 1, 16))
    sizes.add(max_batch)
    return sorted(sizes)


def pad_batch(batch: PagedBatch, size: int, pad_page: int) -> PagedBatch:
    """Append one-token dummy requests reading `pad_page` until the batch has `size` requests."""
    b = batch.batch_size
    if b > size:
        raise ValueError(f"batch of {b} requests exceeds the padded size {size}")
    pad = size - b
    i32 = dict(dtype=torch.int32)
    used = int(batch.kv_indptr[-1])
    return PagedBatch(
        qo_indptr=torch.cat([batch.qo_indptr.to(torch.int32), batch.qo_indptr[-1:].to(torch.int32)
                             + torch.arange(1, pad + 1, **i32)]),
        kv_indptr=torch.cat([batch.kv_indptr.to(torch.int32), batch.kv_indptr[-1:].to(torch.int32)
                             + torch.arange(1, pad + 1, **i32)]),
        kv_indices=torch.cat([batch.kv_indices[:used].to(torch.int32), torch.full((pad,), pad_page, **i32)]),
        kv_last_page_len=torch.cat([batch.kv_last_page_len.to(torch.int32), torch.ones(pad, **i32)]),
        page_size=batch.page_size,
    )


@dataclass
class _Step:
    """The static tensors of one padded batch size (and its graph once captured)."""

    size: int
    inputs: torch.Tensor  # int64 [2 + pools, size]: token ids, positions, one KV-slot row per pool
    attention: dict[str, object]
    pools: list[str]
    logits: torch.Tensor | None = None
    graph: object | None = None  # torch.cuda.CUDAGraph
    staging: torch.Tensor | None = None  # pinned host twin of `inputs`
    # with capture: `inputs`, `staging` and the attention backends' staged inputs are views of
    # one device buffer and its pinned twin, copied in one piece before each replay
    device_bytes: torch.Tensor | None = None
    host_bytes: torch.Tensor | None = None
    staged: object | None = None  # torch.cuda.Event: the last copy out of `host_bytes` has run
    host_mapped: torch.Tensor | None = None  # `host_bytes` as the GPU addresses it (kernels/step_io.py)
    slots: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self.slots = {g: self.inputs[2 + i] for i, g in enumerate(self.pools)}


class DecodeGraphs:
    """Runs decode plans (one new token per request) through per-size static steps."""

    def __init__(
        self,
        model: GptOssModel,
        cache: PagedKVCache,
        max_batch: int,
        *,
        max_context: int,
        capture: bool = True,
    ):
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (use capture=False to run eagerly)")
        self.model = model
        self.cache = cache
        self.capture = capture
        self.sizes = capture_sizes(max_batch)
        self.pools = list(cache.pools)
        # one block per layer group that no request ever gets: the padded rows' KV lives there
        self.pad_block = {g: cache.allocator.allocate(1)[0] for g in self.pools}
        self.max_pages = {"full": cdiv(max_context, cache.page_size)}
        if cache.has_sliding:  # a request's sliding table never exceeds its quota (+1 for slack)
            self.max_pages["sliding"] = min(cdiv(cache.window, cache.page_size) + 2, self.max_pages["full"])
        self._steps: dict[int, _Step] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.world_size = model.shard.world_size

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int | None:
        """The padded size a batch of n requests runs at, None when over the largest."""
        for s in self.sizes:
            if s >= n:
                return s
        return None

    # -- building ------------------------------------------------------------------------------
    def _make_step(self, size: int) -> _Step:
        dev = self.model.device
        if self.capture:
            attention = self.model.make_attention(
                cuda_graph_batch_size=size,
                max_pages_per_request=self.max_pages,
                pad_page=self.pad_block,
            )
        else:
            attention = self.model.make_attention()
        shape = (2 + len(self.pools), size)
        if not self.capture:
            return _Step(size, torch.zeros(shape, dtype=torch.long, device=dev), attention, self.pools)
        # one pinned buffer and its device twin: the step's inputs, then each backend's staged inputs
        parts = [("inputs", None, torch.Size(shape), torch.long)]
        parts += [(name, g, shp, dt) for g, att in attention.items() for name, (shp, dt) in att.staged_inputs().items()]
        offsets, total = [], 0
        for _, _, shp, dt in parts:
            offsets.append(total)
            total += cdiv(shp.numel() * dt.itemsize, 16) * 16
        device_bytes = torch.zeros(total, dtype=torch.uint8, device=dev)
        host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
        views = {}
        for (name, g, shp, dt), off in zip(parts, offsets):
            n = shp.numel() * dt.itemsize
            views[name, g] = (host_bytes[off:off + n].view(dt).view(shp), device_bytes[off:off + n].view(dt).view(shp))
        for g, att in attention.items():
            names = att.staged_inputs()
            if names:
                att.bind_staging({k: views[k, g][0] for k in names}, {k: views[k, g][1] for k in names})
        step = _Step(size, views["inputs", None][1], attention, self.pools, staging=views["inputs", None][0],
                     device_bytes=device_bytes, host_bytes=host_bytes, staged=torch.cuda.Event(),
                     host_mapped=mapped(host_bytes))
        step.staged.record()
        return step

    def _forward(self, step: _Step) -> torch.Tensor:
        ctx = StepContext(self.cache, step.slots, step.attention)
        ids, positions = step.inputs[0], step.inputs[1]
        return self.model.logits(self.model.forward(ids, positions, ctx))

    def _pad_plan(self, step: _Step, n: int, input_ids, positions, slots, batches, device_ids=None) -> None:
        """Fill the static inputs and plan attention for n real rows padded to step.size; the
        first len(device_ids) token ids come from that device tensor (in stream order). Captured
        steps stage everything in one pinned buffer and copy it to the device in one piece."""
        host = step.staging if step.staging is not None else torch.empty(step.inputs.shape, dtype=torch.long)
        if step.staged is not None:
            step.staged.synchronize()  # the previous replay's copy out of `staging` has run
        host[0, :n] = torch.as_tensor(input_ids, dtype=torch.long)
        host[1, :n] = torch.as_tensor(positions, dtype=torch.long)
        host[:2, n:] = 0
        for i, g in enumerate(self.pools):
            host[2 + i, :n] = slots[g]
            host[2 + i, n:] = self.pad_block[g] * self.cache.page_size
        for g, att in step.attention.items():  # a backend bound to the step's staging fills its views
            att.plan(pad_batch(batches[g], step.size, self.pad_block[g]))
        fed = device_ids is None
        if step.host_bytes is not None:  # one copy, ordered before the replay
            if zero_copy(step.device_bytes.device):  # kernels read pinned memory (kernels/step_io.py)
                n = step.host_bytes.numel() if step.host_bytes.numel() <= step_io.STAGE_MAX_BYTES else 0
                if not n:  # a large buffer: the copy engine, then the kernel feeds the ids (row 0 first)
                    step.device_bytes.copy_(step.host_bytes, non_blocking=True)
                    n = 8 * step.size
                stage_step(step.host_mapped[:n], step.device_bytes[:n], device_ids)
                fed = True
            else:
                step.device_bytes.copy_(step.host_bytes, non_blocking=True)
            step.staged.record()
        else:
            step.inputs.copy_(host)
        if not fed:
            step.inputs[0, : device_ids.numel()].copy_(device_ids)

    def _empty_batch(self) -> dict[str, PagedBatch]:
        z = torch.zeros(1, dtype=torch.int32)
        empty = PagedBatch(z, z, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                           self.cache.page_size)
        return {g: empty for g in self.pools}

    def _capture(self, size: int) -> _Step:
        t0 = time.perf_counter()
        step = self._make_step(size)
        self._pad_plan(step, 0, [], [], {g: torch.zeros(0, dtype=torch.long) for g in self.pools},
                       self._empty_batch())
        if not self.capture:
            self._steps[size] = step
            return step
        # warm-up on a side stream (Triton/FlashInfer JIT, cuBLAS workspaces, NCCL communicators)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            self._forward(step)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        mode = "thread_local" if self.world_size > 1 else "global"
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode=mode):
            step.logits = self._forward(step)
        step.graph = graph
        self._steps[size] = step
        log.info("captured the decode step for batch %d in %.1f s", size, time.perf_counter() - t0)
        return step

    def capture_all(self, sizes: list[int] | None = None) -> None:
        """Capture ahead of serving (largest first, so smaller graphs reuse its memory pool).
        Multi-rank: every rank calls it with the same sizes (checked), all succeed or all raise."""
        todo = [s for s in sorted(sizes or self.sizes, reverse=True) if s not in self._steps]
        if self.world_size > 1:
            self._ranks_agree(len(todo), sum(todo), max(todo, default=0), what="capture sizes")
        for s in todo:
            error = None
            try:
                self._capture(s)
            except Exception as e:  # noqa: BLE001 - re-raised once every rank knows
                if self.world_size == 1:
                    raise
                error = e
            if self.world_size > 1:
                self._ranks_agree(int(error is None), what=f"capture of batch size {s}",
                                  cause=error)

    def _ranks_agree(self, *values: int, what: str, cause: Exception | None = None) -> None:
        """Every rank holds the same `values` (an all-reduce of their min and max on the current
        stream, then a device sync: outside any capture, and no watchdog work left pending);
        else raise on every rank."""
        dev = self.model.device
        t = torch.tensor([[v, -v] for v in values], dtype=torch.long, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if cause is not None:
            raise cause
        mine = torch.tensor(values, dtype=torch.long)
        hi, lo = t[:, 0].cpu(), -t[:, 1].cpu()
        if not (torch.equal(hi, mine) and torch.equal(lo, mine)):
            raise RuntimeError(f"decode graphs: the worker's ranks disagree on the {what} (this rank "
                               f"{mine.tolist()}, min {lo.tolist()}, max {hi.tolist()})")

    # -- running -------------------------------------------------------------------------------
    def run(self, input_ids: list[int], positions: list[int], slots: dict[str, torch.Tensor],
            batches: dict[str, PagedBatch], device_ids: torch.Tensor | None = None, copy: bool = True) -> torch.Tensor:
        """One decode step for n = len(input_ids) requests -> float32 logits [n, vocab].
        device_ids: int64 device tensor replacing the first len(device_ids) input ids. copy=False:
        a view of the graph's static output, which the next replay of this size overwrites."""
        n = len(input_ids)
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"decode batch of {n} exceeds the largest captured size {self.max_batch}")
        step = self._steps.get(size)
        if step is None:
            if self.world_size > 1 and self.capture:
                raise RuntimeError(f"decode graph for batch {size} was not captured: a multi-rank worker "
                                   "captures every size up front (capture_all), in step on every rank")
            step = self._capture(size)
        self._pad_plan(step, n, input_ids, positions, slots, batches, device_ids)
        if step.graph is None:
            logits = self._forward(step)
        else:
            step.graph.replay()
            logits = step.logits
        return logits[:n].clone() if copy else logits[:n]  # the static output is overwritten by the next replay
