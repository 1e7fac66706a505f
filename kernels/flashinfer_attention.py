"""Paged sink attention on CUDA through FlashInfer: FA2/FA3 sink wrappers and XQA decode, plus
our Triton split-KV decode kernel (`kernels.triton_decode_attention`).

One `FlashInferSinkAttention` serves one layer type (windowed or full; FlashInfer fixes the
sliding-window flag when it builds the module). `plan(batch)` runs once per step on the host and
moves the batch description to the GPU once; `run(q, kv_cache, sinks)` runs once per layer.

Paths (chosen per batch kind, measured on an H200: docs/kernels.md):
- prefill (any batch with a query longer than 1): `BatchAttentionWithAttentionSinkWrapper`,
  FA3 for full attention, FA2 for the 128-token window (FA3 is slower on a window that short).
- decode (every request has one query): XQA (`xqa_batch_decode_with_kv_cache`) for small
  batches (full layers: < 64k KV tokens; windowed layers: <= 16 requests), the FA2 sink wrapper
  for bigger ones and for page sizes XQA has no kernel for. `decode_backend="triton"`: the
  Triton split-KV kernel instead (same page-table buffers as XQA, the tiling of its layer type:
  `triton_decode_attention.FULL_LAYERS` / `WINDOWED_LAYERS`; "auto" takes it up to
  `_TRITON_MAX_BATCH` requests: windowed layers up to 64, full layers up to 16, as measured). On
  Hopper that mode runs the cluster kernel of `kernels.cuda_decode_attention` where it applies (up
  to 4 requests: a request's splits fold in distributed shared memory), the Triton kernel otherwise.
  A CUDA-graph object with the Triton decode kernel needs no FlashInfer at all.

CUDA graphs (decode): construct with `cuda_graph_batch_size=B, max_pages_per_request=P`. The
object then owns fixed device buffers (page table / indptr arrays sized for B requests of up to
P pages); `plan(batch)` (outside the graph, before every replay) copies the step's batch into
them, padding up to B requests with one-token dummy requests on page `pad_page`; `run` reads only
those buffers, so it can be captured once and replayed:

    attn = FlashInferSinkAttention(dev, ..., cuda_graph_batch_size=B, max_pages_per_request=P)
    attn.plan(warmup_batch); attn.run(q_static, kv, sinks)       # warm-up: loads the module
    with torch.cuda.graph(g): out_static = attn.run(q_static, kv, sinks)
    # every step: attn.plan(batch); q_static[:n].copy_(q); g.replay(); use out_static[:n]

q must have B rows inside the graph (rows past the real batch are padding; their outputs are
finite and meaningless). Windowed and full layers need one object each, per captured B.
"""

from __future__ import annotations

import threading

import torch

from .paged_batch import PagedBatch

_XQA_PAGE_SIZES = (16, 32, 64, 128)
# Decode "auto" (measured on an H200, docs/performance.md): XQA for small batches, the FA2 sink
# wrapper for big ones, by batch size for both layer types (windowed layers: XQA 13 vs 15-17 us up
# to batch 8, FA2 5-12 % faster from batch 32; full layers: XQA 10 % faster at 8 x 4k keys, FA2
# 1.5-14 % faster from 128 x 1k keys). A CUDA graph fixes its kernel for the captured batch size
# whatever the context, so eager steps decide by batch size too: a replayed step equals the eager
# one bit for bit (deciding eager full layers by the KV tokens read made batch 32 at context 1k run
# XQA eagerly and FA2 in its graph).
_XQA_MAX_BATCH = 16
# Our Triton split-KV decode kernel takes decode batches of up to this many requests, per layer
# type, ahead of the rules above (0: never). Measured (H200, bench/decode_attention.py,
# docs/performance.md): windowed layers 0.43-0.67x the best FlashInfer kernel's time at batch
# 1-64, context 1k and 8k (2026-12-01); full layers, with their tiling of 2026-12-02, at or below
# XQA's time at batches 1-16 for every context from 1k to 32k keys (0.71x at 1k, 0.89x at 8k,
# 0.97x at 32k, batch 1). A captured graph keeps its kernel for every context, so the rule holds
# only where the kernel is no slower at any of them.
_TRITON_MAX_BATCH = {"full": 16, "window": 64}

_FA_WORKSPACE_BYTES = 256 << 20
_XQA_WORKSPACE_BYTES = 256 << 20

_workspaces: dict[tuple[str, torch.device], torch.Tensor] = {}
_workspace_lock = threading.Lock()


def _workspace(kind: str, device: torch.device) -> torch.Tensor:
    """One workspace per (kind, device), shared by all layers: layers run one after another."""
    key = (kind, device)
    with _workspace_lock:
        buf = _workspaces.get(key)
        if buf is None:
            size = _FA_WORKSPACE_BYTES if kind == "fa" else _XQA_WORKSPACE_BYTES
            # XQA's semaphores must start at zero; the kernels leave them at zero.
            buf = torch.zeros(size, dtype=torch.uint8, device=device)
            _workspaces[key] = buf
        return buf


class FlashInferSinkAttention:
    """FlashInfer backend of `kernels.attention.make_sink_attention` (same plan/run contract)."""

    def __init__(
        self,
        device: torch.device,
        *,
        window_left: int,
        sm_scale: float,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        prefill_backend: str = "auto",
        decode_backend: str = "auto",
        cuda_graph_batch_size: int | None = None,
        max_pages_per_request: int | None = None,
        pad_page: int = 0,
    ):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer attention needs a CUDA device, got {self.device}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.window_left = int(window_left)
        self.sm_scale = float(sm_scale)
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size

        windowed = self.window_left >= 0
        if prefill_backend == "auto":
            prefill_backend = "fa2" if windowed else "fa3"
        if decode_backend == "auto" and page_size not in _XQA_PAGE_SIZES:
            decode_backend = "fa2"
        if decode_backend == "auto" and cuda_graph_batch_size is not None:
            decode_backend = self._auto_decode(cuda_graph_batch_size)
        if prefill_backend not in ("fa2", "fa3"):
            raise ValueError(f"prefill_backend must be fa2, fa3 or auto, got {prefill_backend!r}")
        if decode_backend not in ("auto", "xqa", "fa2", "fa3", "triton"):
            raise ValueError(f"decode_backend must be xqa, fa2, fa3, triton or auto, got {decode_backend!r}")
        if decode_backend == "xqa" and page_size not in _XQA_PAGE_SIZES:
            raise ValueError(f"XQA supports page sizes {_XQA_PAGE_SIZES}, got {page_size}")
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        if not (decode_backend == "triton" and cuda_graph_batch_size is not None):
            import flashinfer  # noqa: F401  (ImportError -> make_sink_attention falls back to torch)

        self._graph_batch = cuda_graph_batch_size
        self._pad_page = pad_page
        self._wrappers: dict[str, object] = {}
        self._mode: str | None = None  # "prefill" | "decode" after plan()
        self._rows = 0
        if cuda_graph_batch_size is not None:
            if cuda_graph_batch_size < 1 or not max_pages_per_request or max_pages_per_request < 1:
                raise ValueError("CUDA-graph mode needs cuda_graph_batch_size >= 1 and max_pages_per_request >= 1")
            self._init_graph_buffers(cuda_graph_batch_size, max_pages_per_request)

    @property
    def _triton_max_batch(self) -> int:
        return _TRITON_MAX_BATCH["window" if self.window_left >= 0 else "full"]

    @property
    def _triton_config(self):
        """The Triton decode kernel's tiling for this layer type."""
        from .triton_decode_attention import FULL_LAYERS, WINDOWED_LAYERS

        return WINDOWED_LAYERS if self.window_left >= 0 else FULL_LAYERS

    # ---------------------------------------------------------------- construction helpers
    def _init_graph_buffers(self, b: int, max_pages: int) -> None:
        i32 = dict(dtype=torch.int32, device=self.device)
        self._max_pages = max_pages
        if self.decode_backend in ("xqa", "triton"):
            self._block_tables = torch.zeros(b, max_pages, **i32)
            self._seq_lens = torch.ones(b, **i32)
            self._host_tables = torch.zeros(b, max_pages, dtype=torch.int32, pin_memory=True)
            self._host_lens = torch.ones(b, dtype=torch.int32, pin_memory=True)
            # the host may run a step ahead of the GPU: refill the pinned staging buffers only
            # after the previous step's copies out of them have executed (None: bound to a caller's
            # staging, which the caller copies and guards; `bind_staging`)
            self._staged = torch.cuda.Event()
            self._staged.record()
            if self.decode_backend == "triton":
                self._triton_scratch(b)
        else:
            self._graph_bufs = dict(
                qo_indptr_buf=torch.arange(b + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(b + 1, **i32),
                paged_kv_indices_buf=torch.zeros(b * max_pages, **i32),
                paged_kv_last_page_len_buf=torch.ones(b, **i32),
            )

    def staged_inputs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Graph mode with a table-driven decode kernel (triton, xqa): the device inputs each plan()
        stages from pinned host memory, by name; empty otherwise (FlashInfer's graph wrappers
        stage their own)."""
        if self._graph_batch is None or self.decode_backend not in ("xqa", "triton"):
            return {}
        return {"block_tables": (self._block_tables.shape, self._block_tables.dtype),
                "seq_lens": (self._seq_lens.shape, self._seq_lens.dtype)}

    def bind_staging(self, host: dict[str, torch.Tensor], device: dict[str, torch.Tensor]) -> None:
        """Take views of a caller's pinned staging buffer and its device twin for `staged_inputs()`
        (same shapes and dtypes). From then on plan() only fills the host views: the caller copies
        its whole buffer to the device once per step, after every backend has planned, and refills
        it only after that copy has executed (engine.cuda_graphs: one copy a step, not two a
        backend)."""
        want = self.staged_inputs()
        if set(host) != set(want) or set(device) != set(want):
            raise ValueError(f"staging views {sorted(host)} / {sorted(device)} do not match {sorted(want)}")
        for name, (shape, dtype) in want.items():
            for t, pinned in ((host[name], True), (device[name], False)):
                if t.shape != shape or t.dtype != dtype or t.is_pinned() != pinned or not t.is_contiguous():
                    raise ValueError(f"staging view {name} must be a contiguous {'pinned ' if pinned else ''}"
                                     f"{dtype} tensor of shape {tuple(shape)}")
        host["block_tables"].copy_(self._host_tables)
        host["seq_lens"].copy_(self._host_lens)
        device["block_tables"].copy_(self._block_tables)
        device["seq_lens"].copy_(self._seq_lens)
        self._host_tables, self._host_lens = host["block_tables"], host["seq_lens"]
        self._block_tables, self._seq_lens = device["block_tables"], device["seq_lens"]
        self._staged = None

    def _triton_scratch(self, rows: int):
        """Partials for `rows` requests; graph objects size it once. The splits depend on the rows
        and the layer type only (the window bounds a windowed layer's keys), never on the step's
        lengths: an eager step and the graph that replays it split and fold alike (bit for bit)."""
        from .triton_decode_attention import DecodeScratch, num_splits

        max_keys = self.window_left + 1 if self.window_left >= 0 else None
        splits = num_splits(rows, self.num_kv_heads, max_keys, self.device, self._triton_config)
        s = getattr(self, "_scratch", None)
        if s is None or not s.fits(rows, self.num_kv_heads, splits):
            s = self._scratch = DecodeScratch(rows, self.num_kv_heads, self.num_qo_heads // self.num_kv_heads,
                                              self.head_dim, splits, self.device)
        return s

    def _wrapper(self, backend: str, graph: bool = False):
        key = f"{backend}{'-graph' if graph else ''}"
        w = self._wrappers.get(key)
        if w is None:
            import flashinfer

            kwargs = dict(self._graph_bufs, use_cuda_graph=True) if graph else {}
            w = flashinfer.BatchAttentionWithAttentionSinkWrapper(
                _workspace("fa", self.device), kv_layout="NHD", backend=backend,
                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                head_dim_qk=self.head_dim, head_dim_vo=self.head_dim, window_left=self.window_left,
                **kwargs,
            )
            self._wrappers[key] = w
        return w

    # ---------------------------------------------------------------- plan
    def plan(self, batch: PagedBatch) -> None:
        if batch.page_size != self.page_size:
            raise ValueError(f"batch page size {batch.page_size} != attention page size {self.page_size}")
        decode = batch.is_decode
        if self._graph_batch is not None:
            if not decode:
                raise ValueError("a CUDA-graph attention object only plans decode batches")
            self._plan_graph(batch)
            return
        self._rows = int(batch.qo_indptr[-1])
        decode_backend = self._pick_decode(batch) if decode else None
        if decode_backend in ("xqa", "triton"):
            self._plan_xqa(batch)
            if decode_backend == "triton":
                self._triton_scratch(batch.batch_size)
                self._mode = "triton"
        else:
            backend = decode_backend or self.prefill_backend
            self._plan_fa(self._wrapper(backend), batch)
            self._active = self._wrappers[backend]
            self._mode = "fa"

    def _auto_decode(self, batch_size: int) -> str:
        """The "auto" decode kernel for a batch of `batch_size` requests. One rule for eager steps
        and captured graphs (which fix the kernel for the captured size), so a replayed step equals
        the eager step bit for bit: by batch size, not by the KV tokens a step reads."""
        if batch_size <= self._triton_max_batch:
            return "triton"
        return "xqa" if batch_size <= _XQA_MAX_BATCH else "fa2"

    def _pick_decode(self, batch: PagedBatch) -> str:
        if self.decode_backend != "auto":
            return self.decode_backend
        return self._auto_decode(batch.batch_size)

    def _plan_fa(self, wrapper, batch: PagedBatch) -> None:
        wrapper.plan(
            batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=True, window_left=self.window_left,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )

    @staticmethod
    def _page_table(batch: PagedBatch, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """kv_indptr/kv_indices -> dense [B, width] page table (host), zero-padded."""
        pages = (batch.kv_indptr[1:] - batch.kv_indptr[:-1]).to(torch.int64)
        b = pages.numel()
        table = out if out is not None else torch.zeros(b, width, dtype=torch.int32)
        used = torch.arange(width)[None, :] < pages[:, None]
        table[:b].zero_()
        table[:b][used] = batch.kv_indices[: int(batch.kv_indptr[-1])].to(torch.int32)
        return table

    def _plan_xqa(self, batch: PagedBatch) -> None:
        pages = batch.kv_indptr[1:] - batch.kv_indptr[:-1]
        width = max(int(pages.max()), 1)
        table = self._page_table(batch, width)
        self._block_tables = table.to(self.device, non_blocking=True)
        self._seq_lens = batch.kv_lens.to(torch.int32).to(self.device, non_blocking=True)
        self._mode = "xqa"

    def _plan_graph(self, batch: PagedBatch) -> None:
        b_max, p_max = self._graph_batch, self._max_pages
        b = batch.batch_size
        pages = batch.kv_indptr[1:] - batch.kv_indptr[:-1]
        if b > b_max:
            raise ValueError(f"batch of {b} requests exceeds the captured batch size {b_max}")
        if b and int(pages.max()) > p_max:
            raise ValueError(f"a request uses {int(pages.max())} pages, over max_pages_per_request={p_max}")
        self._rows = b_max
        if self.decode_backend in ("xqa", "triton"):
            if self._staged is not None:
                self._staged.synchronize()
            self._page_table(batch, p_max, self._host_tables)
            self._host_tables[b:].fill_(self._pad_page)
            self._host_lens[:b] = batch.kv_lens.to(torch.int32)
            self._host_lens[b:] = 1
            if self._staged is not None:
                # pinned -> device on the current stream, ordered before the graph replay
                self._block_tables.copy_(self._host_tables, non_blocking=True)
                self._seq_lens.copy_(self._host_lens, non_blocking=True)
                self._staged.record()
            self._mode = self.decode_backend
            return
        pad = b_max - b
        i32 = dict(dtype=torch.int32)
        qo = torch.arange(b_max + 1, **i32)
        kv_indptr = torch.cat([batch.kv_indptr.to(torch.int32),
                               batch.kv_indptr[-1:].to(torch.int32) + torch.arange(1, pad + 1, **i32)])
        kv_indices = torch.cat([batch.kv_indices[: int(batch.kv_indptr[-1])].to(torch.int32),
                                torch.full((pad,), self._pad_page, **i32)])
        last = torch.cat([batch.kv_last_page_len.to(torch.int32), torch.ones(pad, **i32)])
        padded = PagedBatch(qo, kv_indptr, kv_indices, last, self.page_size)
        wrapper = self._wrapper(self.decode_backend, graph=True)
        self._plan_fa(wrapper, padded)
        self._active = wrapper
        self._mode = "fa"

    # ---------------------------------------------------------------- run
    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, sinks: torch.Tensor, out: torch.Tensor | None = None,
        early_launch: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D] bf16, kv_cache [pages, 2, page, Hkv, D] bf16, sinks float32 [Hq] (raw
        logits, not scaled by sm_scale) -> [T, Hq, D] bf16 (written into `out` when given).
        early_launch: the kernel after this one reads nothing but weights ahead of its PDL wait, so the
        cluster decode kernel, where it serves, lets it launch at its start (kernels/pdl.py's exception;
        the other kernels launch it after their wait, as always)."""
        if self._mode is None:
            raise RuntimeError("run() before plan()")
        if q.shape[0] != self._rows:
            raise ValueError(f"planned for {self._rows} query rows, got {q.shape[0]}")
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks must be float32 (cast the bf16 checkpoint values), got {sinks.dtype}")
        if self._mode == "triton":
            from . import cuda_decode_attention as cda
            from .triton_decode_attention import paged_decode_attention

            if cda.ENABLED and cda.applies(q, kv_cache, self.window_left):
                return cda.decode_attention(q, kv_cache, self._block_tables, self._seq_lens, sinks, self.sm_scale,
                                            self.window_left, self._scratch, out=out, early_launch=early_launch)

            return paged_decode_attention(q, kv_cache, self._block_tables, self._seq_lens, sinks, self.sm_scale,
                                          self.window_left, self._scratch, out=out, cfg=self._triton_config)
        if self._mode == "xqa":
            from flashinfer.decode import xqa_batch_decode_with_kv_cache

            return xqa_batch_decode_with_kv_cache(
                q, kv_cache, _workspace("xqa", self.device), self._block_tables, self._seq_lens,
                self._block_tables.shape[1] * self.page_size,
                bmm1_scale=self.sm_scale, bmm2_scale=1.0, window_left=self.window_left,
                out=out, sinks=sinks, kv_layout="NHD",
            )
        return self._active.run(q, kv_cache, sinks, self.sm_scale, out=out)
