"""The GPT-OSS forward pass on one rank of a worker.

embedding -> N x (attention block, MoE block) -> RMSNorm -> unembedding, each block pre-normed
with a residual. The model keeps the signature `forward(input_ids, positions, step)`; `step`
(a `StepContext`) carries what one engine step knows about its batch: where each new token's K/V
goes in the paged cache and the planned attention backends for each layer group.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import make_sink_attention
from pdserve.kernels.experts import route
from pdserve.kernels.fp8 import fp8_weight_linear_ref
from pdserve.kernels.moe import experts_forward
from pdserve.kernels.paged_batch import PagedBatch

from .checkpoint import ModelWeights
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .parallel import ShardSpec, all_gather_last, all_reduce
from .rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t = x.float()
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return (t * weight).to(x.dtype)


def fused_kernels_wanted(device: torch.device) -> bool:
    """The Triton per-layer kernels (kernels.triton_norm / _rope / _router / _bf16_gemv) run on
    CUDA unless PDSERVE_FUSED_KERNELS=0 (the plain-torch path: the reference the GPU tests compare
    with)."""
    if device.type != "cuda" or os.environ.get("PDSERVE_FUSED_KERNELS", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def linear_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8-weight linear layer (e4m3 weights, 128x128 block scales): [M, K] -> [M, N] in x.dtype.
    On CUDA the Triton kernel (kernels.triton_fp8_linear, launch shape by M), elsewhere the
    reference of its default mode (kernels.fp8.fp8_weight_linear_ref), rounded once to x.dtype."""
    if x.is_cuda:
        try:
            from pdserve.kernels.triton_fp8_linear import fp8_linear
        except ImportError:
            fp8_linear = None
        if fp8_linear is not None:
            return fp8_linear(x, w, w_scale, bias)
    return fp8_weight_linear_ref(x, w, w_scale, bias).to(x.dtype)


def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
             gemv: bool = False, staged: bool = False):
    """An attention projection: bf16 weights through cuBLAS (or, with `gemv`, decode batches where
    kernels.triton_bf16_gemv measured faster: bandwidth-bound, where cuBLAS streams these weights
    at 1.9-2.8 TB/s; with `staged` as well, up to cuda_gemv_staged.MAX_TOKENS tokens through the GEMV
    that stages its weights in shared memory while the launch before it runs: the projection after
    the attention), or e4m3 weights with 128x128 block scales (attention precision fp8) through
    `linear_fp8` (with `gemv`, up to cuda_gemv_fp8.MAX_TOKENS tokens through the FP8 GEMV
    that stages its weights in shared memory, part of them ahead of its PDL wait)."""
    if _fp8_gemv_takes(x, w, bias, scale, gemv):
        from pdserve.kernels.cuda_gemv_fp8 import gemv_fp8

        return gemv_fp8(x, w, scale, bias)
    if scale is None:
        if staged and _staged_gemv_takes(x, w, bias, gemv):
            from pdserve.kernels.cuda_gemv_staged import gemv_staged

            return gemv_staged(x, w, bias)
        if gemv and x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and w.stride(1) == 1:
            from pdserve.kernels.triton_bf16_gemv import bf16_gemv, gemv_wins

            if gemv_wins(x.shape[0], *w.shape):
                return bf16_gemv(x, w, bias)
        return F.linear(x, w, bias)
    return linear_fp8(x, w, scale, bias)


def _unembed(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """The vocabulary projection (no bias): bf16 weights as `_project` takes them (with `fused`, the
    bf16 GEMV where it measured faster than cuBLAS), or e4m3 weights with 128x128 block scales
    (unembedding precision fp8): with `fused`, up to cuda_gemv_fp8.STREAM_MAX_TOKENS tokens through
    the streaming FP8 GEMV (580 MB of weights at 88 % of the copy bandwidth, where the other FP8 paths
    reach 55-60 %), else `linear_fp8`."""
    if scale is None:
        return _project(x, w, None, None, gemv=fused)
    if fused and x.is_cuda and x.dtype == torch.bfloat16 and x.stride(1) == 1 and w.is_contiguous():
        from pdserve.kernels import cuda_gemv_fp8 as gf

        if x.shape[0] <= gf.STREAM_MAX_TOKENS and gf.stream_fits(x.shape[0], *w.shape) and gf.available(x.device):
            return gf.gemv_fp8_stream(x, w, scale)
    return linear_fp8(x, w, scale)


def _staged_gemv_takes(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> bool:
    """Whether `_project` (with `gemv` and `staged`) sends this bf16 projection to the GEMV that stages its
    weights in shared memory ahead of its PDL wait (kernels.cuda_gemv_staged)."""
    if not (gemv and x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and w.stride(1) == 1):
        return False
    from pdserve.kernels import cuda_gemv_staged as gs

    return (x.shape[0] <= gs.MAX_TOKENS and gs.fits(x.shape[0], *w.shape) and x.is_contiguous() and w.is_contiguous()
            and (bias is None or bias.dtype == torch.bfloat16) and gs.available(x.device))


def _fp8_gemv_takes(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                    gemv: bool) -> bool:
    """Whether `_project` (with `gemv`) sends this projection to the FP8 GEMV (kernels.cuda_gemv_fp8):
    FP8 weights (a scale), a decode batch it takes, on a GPU where it builds."""
    if scale is None or not gemv:
        return False
    from pdserve.kernels import cuda_gemv_fp8 as gf

    return (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] <= gf.MAX_TOKENS and gf.fits(x.shape[0], *w.shape)
            and x.stride(1) == 1 and w.is_contiguous() and (bias is None or bias.dtype == torch.bfloat16)
            and gf.available(x.device))


def _qkv_rope_fused(t: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether one token's QKV projection, RoPE and KV write run as one kernel
    (kernels.triton_rope.qkv_rope_write): where `_project` would take the bf16 GEMV."""
    if scale is not None or t.shape[0] != 1 or not t.is_cuda or t.dtype != torch.bfloat16 or w.dtype != t.dtype:
        return False
    from pdserve.kernels.triton_bf16_gemv import gemv_wins

    return w.stride(1) == 1 and gemv_wins(1, *w.shape)


@dataclass
class StepContext:
    """One step's batch as the layers see it: KV slots per pool, planned attention per pool."""

    cache: PagedKVCache
    slots: dict[str, torch.Tensor]  # pool -> [T] flat slot of each new token
    attention: dict[str, object]  # pool -> planned backend


class GptOssModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        *,
        shard: ShardSpec = ShardSpec(),
        device: torch.device | str = "cpu",
        page_size: int = 16,
        attention_backend: str = "auto",
        fused: bool | None = None,
    ):
        """fused: the Triton per-layer kernels (residual + RMSNorm, RoPE + KV write, router, the
        bf16 projection GEMV for small batches); None = `fused_kernels_wanted(device)`."""
        self.cfg = cfg
        self.w = weights
        self.shard = shard
        self.device = torch.device(device)
        q0, q1 = shard.q_head_range(cfg.num_attention_heads)
        k0, k1 = shard.kv_head_range(cfg.num_key_value_heads)
        self.num_q_heads, self.num_kv_heads = q1 - q0, k1 - k0
        self.rope = RotaryEmbedding(cfg, self.device)
        self.page_size = page_size
        self.attention_backend = attention_backend
        self.fused = fused_kernels_wanted(self.device) if fused is None else fused
        # with `fused`: one token's QKV GEMV + RoPE + KV write in one launch (False: two fused
        # kernels; benchmarks and tests compare the two)
        self.fuse_qkv_rope = True
        # with `fused`: the norm before an FP8 QKV GEMV lets it launch at the norm's start
        # (`_qkv_launches_early`; False: after the norm's wait, as every other kernel; the benchmark's A/B)
        self.early_qkv_launch = True
        # with `fused`: the norm before the router lets it launch at the norm's start, so that the router's
        # weights (read ahead of its wait) stream during the attention block's end (`_router_launches_early`;
        # off: it measured slower in the twentieth round, and x1.056 a 120b step on an H100 in the forty-fourth, where
        # the router gained 1 us and the MoE after it lost 10; the benchmark's A/B)
        self.early_router_launch = False
        # with `fused`: the decode attention lets the output projection launch at the attention's start, where
        # that projection is one of the GEMVs that read nothing but weights ahead of their PDL wait, so that
        # its weights stream during the QKV launch's end and the attention (`_o_launches_early`; off: 120b's step
        # measured 0.9 % slower on an H200, its CTAs lengthen the QKV launch and the attention; the benchmark's A/B)
        self.early_o_launch = False
        # with `fused`: which of the next layer's FP8 attention weights ("qkv", "o") each MXFP4 launch of the MoE
        # ("gate_up", "down") requests into L2, so that the GEMV that reads them copies them from there
        # (`_next_layer_weights`; the benchmark's A/B), e.g. {"down": "qkv"}; {}: none (every plan measured 1-2 %
        # slower at one token on an H200: the GEMVs were not waiting on their bytes, and the requests slow the MoE)
        self.prefetch_next: dict[str, str] = {}

    def make_attention(
        self,
        cuda_graph_batch_size: int | None = None,
        max_pages_per_request: dict[str, int] | None = None,
        pad_page: dict[str, int] | None = None,
    ) -> dict[str, object]:
        """One backend per layer group (windowed / full), planned once per step. With
        `cuda_graph_batch_size`, FlashInfer graph-mode objects for decode batches of that size
        (per group: page-table width and pad page; see engine.cuda_graphs)."""
        backends = {}
        groups = {"full": -1}
        if self.cfg.sliding_window > 0 and any(self.cfg.is_sliding(i) for i in range(self.cfg.num_hidden_layers)):
            groups["sliding"] = self.cfg.sliding_window - 1
        for g, window_left in groups.items():
            graph = {}
            if cuda_graph_batch_size is not None:
                graph = dict(cuda_graph_batch_size=cuda_graph_batch_size,
                             max_pages_per_request=max_pages_per_request[g], pad_page=pad_page[g])
            backends[g] = make_sink_attention(
                self.device, window_left=window_left, sm_scale=self.cfg.sm_scale,
                num_qo_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.cfg.head_dim, page_size=self.page_size, backend=self.attention_backend,
                **graph,
            )
        return backends

    # -- blocks --------------------------------------------------------------------------------
    # Each block takes the normed input `t` and returns its output before the residual add; the
    # forward adds it and norms for the next block in one step (`_add_norm`).
    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, early_launch: bool = False):
        """(x + delta, rms_norm(x + delta) * weight); delta None: (x, rms_norm(x) * weight).
        `early_launch`: the kernel after the norm reads only weights ahead of its PDL wait, so it may
        launch at the norm's start (kernels/pdl.py)."""
        if self.fused:
            from pdserve.kernels.triton_norm import add_rms_norm

            return add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps, early_launch)
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _attention(self, layer: int, t: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        a, _ = self.w.layers[layer]
        group, _ = step.cache.layer_group[layer]
        cache = step.cache.layer_cache(layer)
        q = self._rotated_q(layer, t, positions, step, group, cache)
        o = step.attention[group].run(q, cache, a.sinks, early_launch=self._o_launches_early(layer, q))
        o = _project(o.reshape(-1, self.num_q_heads * self.cfg.head_dim), a.o_weight, a.o_bias, a.o_scale,
                     self.fused, staged=True)
        return all_reduce(o, self.shard)

    def _rotated_q(self, layer: int, t: torch.Tensor, positions: torch.Tensor, step: StepContext, group: str,
                   cache: torch.Tensor) -> torch.Tensor:
        """The QKV projection with RoPE: k and v written to the token's KV slots, rotated q returned
        [T, Hq, D] (one launch for up to cuda_gemv_fp8.MAX_TOKENS tokens with FP8 weights, or for one
        token where the bf16 GEMV serves; else the projection then the fused epilogue, else the plain
        torch path)."""
        a, _ = self.w.layers[layer]
        if (self.fuse_qkv_rope and _fp8_gemv_takes(t, a.qkv_weight, a.qkv_bias, a.qkv_scale, self.fused)
                and self._fp8_rope_fits(t, cache, positions, step.slots[group])):
            from pdserve.kernels.cuda_gemv_fp8 import qkv_rope_fp8

            return qkv_rope_fp8(t, a.qkv_weight, a.qkv_scale, a.qkv_bias, positions, self.rope.cos, self.rope.sin,
                                step.slots[group], cache, self.num_q_heads, self.num_kv_heads)
        if self.fused and self.fuse_qkv_rope and _qkv_rope_fused(t, a.qkv_weight, a.qkv_scale):
            from pdserve.kernels.triton_rope import qkv_rope_write

            return qkv_rope_write(t, a.qkv_weight, a.qkv_bias, positions, self.rope.cos, self.rope.sin,
                                  step.slots[group], cache, self.num_q_heads, self.num_kv_heads)
        qkv = _project(t, a.qkv_weight, a.qkv_bias, a.qkv_scale, self.fused)
        if self.fused:
            from pdserve.kernels.triton_rope import rope_qkv_write

            return rope_qkv_write(qkv, positions, self.rope.cos, self.rope.sin, step.slots[group], cache,
                                  self.num_q_heads, self.num_kv_heads)
        D = self.cfg.head_dim
        nq, nkv = self.num_q_heads * D, self.num_kv_heads * D
        q = qkv[:, :nq].view(-1, self.num_q_heads, D)
        k = qkv[:, nq : nq + nkv].view(-1, self.num_kv_heads, D)
        v = qkv[:, nq + nkv :].view(-1, self.num_kv_heads, D)
        q, k = self.rope(q, positions), self.rope(k, positions)
        step.cache.write(layer, step.slots, k, v)
        return q.contiguous()

    def _fp8_rope_fits(self, t: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> bool:
        """Whether the FP8 QKV GEMV can carry the RoPE + KV-write epilogue for these tokens
        (kernels.cuda_gemv_fp8.qkv_rope_fp8): its head dim, a bf16 cache, contiguous int64 positions
        and slots."""
        from pdserve.kernels.cuda_gemv_fp8 import fits_rope

        return (cache.dtype == torch.bfloat16 and self.rope.cos.dtype == torch.float32
                and all(v.dtype == torch.int64 and v.is_contiguous() for v in (positions, slots))
                and fits_rope(t.shape[0], t.shape[1], self.num_q_heads, self.num_kv_heads, self.cfg.head_dim))

    def _qkv_launches_early(self, layer: int, x: torch.Tensor) -> bool:
        """Whether the layer's QKV projection of these tokens is the FP8 GEMV, which requests all of its
        weights ahead of its PDL wait, so that the norm before it lets it launch at the norm's start
        (kernels/pdl.py; measured a gain only there)."""
        a, _ = self.w.layers[layer]
        return self.early_qkv_launch and _fp8_gemv_takes(x, a.qkv_weight, a.qkv_bias, a.qkv_scale, self.fused)

    def _o_launches_early(self, layer: int, q: torch.Tensor) -> bool:
        """Whether the attention of these queries [T, Hq, D] may let the output projection launch at its start
        (kernels/pdl.py's exception): `_project` sends the projection of the attention's output to the FP8 GEMV
        or the staged bf16 GEMV, both of which read only weights ahead of their wait. The output has q's shape
        and strides (the kernels that honour the flag allocate it like q), so q's rows stand in for it."""
        if not (self.early_o_launch and self.fused) or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            return False  # (heads that do not flatten into rows without a copy: O takes its input otherwise)
        a, _ = self.w.layers[layer]
        rows = q.view(q.shape[0], -1)
        return (_fp8_gemv_takes(rows, a.o_weight, a.o_bias, a.o_scale, True)
                or (a.o_scale is None and _staged_gemv_takes(rows, a.o_weight, a.o_bias, True)))

    def _next_layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """What each launch of the MoE of `layer` asks to have in L2 (`prefetch_next`): the next layer's FP8 QKV
        (14.7 MB for gpt-oss) and O (11.8 MB) weights, which their GEMVs copy ahead of their PDL wait; none after
        the last layer or with bf16 projections."""
        if not (self.prefetch_next and self.fused) or layer + 1 >= len(self.w.layers):
            return {}
        a, _ = self.w.layers[layer + 1]
        if a.qkv_scale is None or a.o_scale is None:
            return {}
        weights = {"qkv": a.qkv_weight, "o": a.o_weight}
        return {launch: weights[which] for launch, which in self.prefetch_next.items()}

    def _routes_fused(self, t: torch.Tensor) -> bool:
        """Whether these tokens are routed by route_fused (the cluster or the Triton router), not the torch path."""
        from pdserve.kernels.triton_router import MAX_TOKENS

        return self.fused and self.cfg.experts_per_token == 4 and t.shape[0] <= MAX_TOKENS

    def _router_launches_early(self, x: torch.Tensor) -> bool:
        """Whether the norm before the MoE block lets the router launch at the norm's start (kernels/pdl.py's
        exception): both fused routers read nothing but weights ahead of their PDL wait."""
        return self.early_router_launch and self._routes_fused(x)

    def _route(self, t: torch.Tensor, m) -> tuple[torch.Tensor, torch.Tensor]:
        if self._routes_fused(t):
            from pdserve.kernels.triton_router import route_fused

            return route_fused(t, m.router_weight, m.router_bias, 4)
        return route(t, m.router_weight, m.router_bias, self.cfg.experts_per_token)

    def _moe(self, layer: int, t: torch.Tensor) -> torch.Tensor:
        # TP dispatch/combine: x is replicated on every rank and routed with the full router;
        # each rank runs only its local experts (its slice of their channels) on the tokens routed
        # to them; one all-reduce sums the ranks' weighted partial outputs (engine/parallel.py).
        _, m = self.w.layers[layer]
        cfg = self.cfg
        weights, ids = self._route(t, m)  # from t, on the GPU: t predates the routing's launch
        y = experts_forward(t, weights, ids, m.experts, cfg.swiglu_limit, cfg.swiglu_alpha, x_before_routing=True,
                            l2_prefetch=self._next_layer_weights(layer))
        return all_reduce(y, self.shard)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world_size == 1:
            return F.embedding(input_ids, self.w.embedding)
        local = input_ids - self.w.vocab_start
        mine = (local >= 0) & (local < self.w.embedding.shape[0])
        x = F.embedding(local.clamp(0, self.w.embedding.shape[0] - 1), self.w.embedding)
        return all_reduce(x * mine[:, None].to(x.dtype), self.shard)

    # -- public --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H] (before the last norm)."""
        x = self._embed(input_ids)
        layers = self.w.layers
        x, t = self._add_norm(x, None, layers[0][0].norm, self._qkv_launches_early(0, x))
        for i in range(self.cfg.num_hidden_layers):
            x, t = self._add_norm(x, self._attention(i, t, positions, step), layers[i][1].norm,
                                  self._router_launches_early(x))
            y = self._moe(i, t)
            if i + 1 < len(layers):
                x, t = self._add_norm(x, y, layers[i + 1][0].norm, self._qkv_launches_early(i + 1, x))
            else:
                x = x + y
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> float32 logits [T, vocab] (gathered over vocab shards)."""
        _, h = self._add_norm(hidden, None, self.w.norm)
        out = _unembed(h, self.w.unembedding, self.w.unembedding_scale, self.fused).float()
        out = all_gather_last(out, self.shard)
        return out[:, : self.cfg.vocab_size]


def make_batches(
    cache: PagedKVCache,
    tables: list[dict[str, tuple[list[int], int]]],
    qo_lens: list[int],
) -> dict[str, PagedBatch]:
    """Each pool's attention batch for a step: per request, its (table, kv_len) per pool."""
    return {
        group: PagedBatch.from_tables(qo_lens, [t[group][1] for t in tables], [t[group][0] for t in tables],
                                      cache.page_size)
        for group in cache.pools
    }


def plan_step(attention: dict[str, object], batches: dict[str, PagedBatch]) -> None:
    """Plan each pool's backend for the step's batch."""
    for group, backend in attention.items():
        backend.plan(batches[group])
