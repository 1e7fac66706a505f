"""Paged attention with per-head sinks (gpt-oss), for prefill and batched decode.

A sink is one learned logit per query head that joins the softmax denominator and carries no
value. KV cache layout (FlashInfer "NHD", one tensor per layer):
    kv_cache [num_blocks, 2, page_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
A batch is described FlashInfer-style by `kernels.paged_batch.PagedBatch`; queries of request i
are the last `qo_len_i` positions of its `kv_len_i` keys (causal). `window_left` follows FlashInfer: a key is
visible when q_pos - k_pos <= window_left (-1 = unbounded); gpt-oss' 128-token window is 127.

`make_sink_attention` returns the FlashInfer backend on CUDA (see kernels.flashinfer_attention)
and the torch reference elsewhere. Both follow plan() once per batch, run() once per layer.
"""

from __future__ import annotations

import torch

from .paged_batch import PagedBatch


def sink_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    window_left: int = -1,
) -> torch.Tensor:
    """One request, contiguous: q [Tq, Hq, D], k/v [Tk, Hkv, D] (queries are the last Tq keys)
    -> [Tq, Hq, D] in q.dtype. Float32 softmax with the sink logit in the denominator."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    qf = q.float().reshape(tq, hkv, rep, d)
    scores = torch.einsum("qhrd,khd->hrqk", qf, k.float()) * sm_scale
    qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    visible = kpos <= qpos
    if window_left >= 0:
        visible &= qpos - kpos <= window_left
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().reshape(hkv, rep, 1, 1).expand(hkv, rep, tq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hrqk,khd->qhrd", probs, v.float())
    return out.reshape(tq, hq, d).to(q.dtype)


class TorchSinkAttention:
    """Reference backend: gathers each request's pages and runs `sink_attention_ref`."""

    def __init__(self, window_left: int, sm_scale: float):
        self.window_left = window_left
        self.sm_scale = sm_scale
        self._batch: PagedBatch | None = None

    def plan(self, batch: PagedBatch) -> None:
        self._batch = batch
        self._kv_lens = batch.kv_lens.tolist()
        self._qo = batch.qo_indptr.tolist()
        self._kv = batch.kv_indptr.tolist()

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, sinks: torch.Tensor,
            early_launch: bool = False) -> torch.Tensor:
        """early_launch: a launch-order hint for the GPU kernels (FlashInferSinkAttention.run); none here."""
        b = self._batch
        if b is None:
            raise RuntimeError("run() before plan()")
        if q.shape[0] != self._qo[-1]:
            raise ValueError(f"planned for {self._qo[-1]} query rows, got {q.shape[0]}")
        out = torch.empty_like(q)
        pages_all = b.kv_indices.to(kv_cache.device, torch.long)
        for i, kv_len in enumerate(self._kv_lens):
            pages = pages_all[self._kv[i] : self._kv[i + 1]]
            kv = kv_cache[pages]  # [P, 2, page, Hkv, D]
            k = kv[:, 0].flatten(0, 1)[:kv_len]
            v = kv[:, 1].flatten(0, 1)[:kv_len]
            s, e = self._qo[i], self._qo[i + 1]
            out[s:e] = sink_attention_ref(q[s:e], k, v, sinks, self.sm_scale, self.window_left)
        return out


def make_sink_attention(
    device: torch.device,
    *,
    window_left: int,
    sm_scale: float,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    backend: str = "auto",
    **options,
):
    """The attention backend for one layer type (windowed or full) on `device`.

    backend: "auto" (FlashInfer on CUDA when installed, else torch), "torch" or "flashinfer".
    options: `FlashInferSinkAttention`'s keyword arguments: graph mode (cuda_graph_batch_size,
    max_pages_per_request, pad_page; only the CUDA backend has a capturable decode path), the
    prefill / decode kernels (prefill_backend, decode_backend). A graph-mode object whose decode
    kernel is "triton" needs no FlashInfer.
    """
    device = torch.device(device)
    graph = options.get("cuda_graph_batch_size") is not None
    need = "a CUDA-graph attention backend needs FlashInfer on a CUDA device"
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        if graph:
            raise RuntimeError(need)
        return TorchSinkAttention(window_left, sm_scale)
    from .flashinfer_attention import FlashInferSinkAttention

    if not (graph and options.get("decode_backend") == "triton"):
        try:
            import flashinfer  # noqa: F401  (the wrapper module itself imports it lazily)
        except ImportError as e:
            if backend == "flashinfer" or graph:
                raise RuntimeError(f"{need}; FlashInfer is unavailable: {e}") from e
            return TorchSinkAttention(window_left, sm_scale)
    return FlashInferSinkAttention(
        device, window_left=window_left, sm_scale=sm_scale, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, **options,
    )
