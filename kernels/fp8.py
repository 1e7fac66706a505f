"""FP8 (e4m3) with one float32 scale per 128x128 weight block and per 1x128 activation group.

Layout convention: weights are (out, in) = [..., N, K], stored unpadded; the scale grid is
[..., ceil(N/128), ceil(K/128)] and a ragged last block is scaled over its real elements only
(2880 = 22 * 128 + 64, so gpt-oss' hidden dimension ends in a 64-wide block). Kernels mask the
tail. The expert intermediate dimension is padded instead (see `pad_intermediate`), so that every
TP shard of it is made of whole 128-blocks.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks_view(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Zero-pad [..., N, K] to whole blocks and view as [..., nb, 128, kb, 128]."""
    *lead, n, k = w.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    padded = torch.nn.functional.pad(w, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    return padded.reshape(*lead, nb, BLOCK, kb, BLOCK), n, k


def _unblock(b: torch.Tensor, n: int, k: int) -> torch.Tensor:
    *lead, nb, _, kb, _ = b.shape
    return b.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k]


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (fp8 [..., N, K], float32 scales [..., ceil(N/128), ceil(K/128)]), amax/448."""
    b, n, k = _blocks_view(w.float())
    amax = b.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return _unblock(q, n, k).contiguous(), scale.squeeze(-1).squeeze(-2).contiguous()


def dequantize_weight_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    b, n, k = _blocks_view(q.float())
    return _unblock(b * scale[..., :, None, :, None], n, k).to(dtype)


def quantize_weight_fp8_exact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `quantize_weight_fp8`, but a block whose values e4m3 can hold exactly under a
    power-of-two scale gets that scale, 2^ceil(log2(amax/448)); the others keep amax/448.

    For MXFP4-decoded weights (fp4 * 2^e) that makes the conversion lossless whenever a block's
    group exponents span at most 14 binades (e4m3 holds fp4 * 2^d for d in [-8, 6]). Returns
    (fp8, scales, exact) with `exact` a bool [..., nb, kb] mask of the blocks kept bit-exact.
    """
    b, n, k = _blocks_view(w.float())
    amax = b.abs().amax(dim=(-3, -1), keepdim=True)
    pow2 = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(2.0**-120) / FP8_MAX)))
    q2 = (b / pow2).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    exact = ((q2.float() * pow2) == b).all(dim=-3, keepdim=True).all(dim=-1, keepdim=True)
    lin = amax.clamp_min(1e-12) / FP8_MAX
    scale = torch.where(exact, pow2, lin)
    q_lin = (b / lin).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = torch.where(exact, q2.float(), q_lin.float()).to(FP8)  # both exact in e4m3
    squeeze = lambda t: t.squeeze(-1).squeeze(-2).contiguous()
    return _unblock(q, n, k).contiguous(), squeeze(scale), squeeze(exact)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 groups: [T, K] -> (fp8 [T, K], float32 [T, ceil(K/128)])."""
    t, k = x.shape
    kb = cdiv(k, BLOCK)
    g = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).reshape(t, kb, BLOCK)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(t, kb * BLOCK)[:, :k]
    return q.contiguous(), scale.squeeze(-1).contiguous()


def dequantize_act_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t, k = q.shape
    kb = scale.shape[-1]
    g = torch.nn.functional.pad(q.float(), (0, kb * BLOCK - k)).reshape(t, kb, BLOCK)
    return (g * scale[..., None]).reshape(t, kb * BLOCK)[:, :k]


def fp8_linear_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the FP8 GEMM computes: 1x128-quantised activations times 128x128-block weights,
    float32 accumulation started from the bias. x [T, K] -> float32 [T, N]."""
    xq, xs = quantize_act_fp8(x)
    out = dequantize_act_fp8(xq, xs) @ dequantize_weight_fp8(w, w_scale).T
    if bias is not None:
        out = out + bias.float()
    return out


def fp8_weight_linear_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the FP8-weight linear layer computes with x kept as it is (kernels.triton_fp8_linear's
    default mode): x times the dequantised 128x128-block weights, float32 accumulation started
    from the bias. x [M, K] -> float32 [M, N]."""
    out = x.float() @ dequantize_weight_fp8(w, w_scale).T
    if bias is not None:
        out = out + bias.float()
    return out


def pad_intermediate(size: int, max_tp: int = 8) -> int:
    """Expert intermediate size after FP8 padding: a multiple of 128 * max_tp, so each of TP
    1, 2, 4, 8 shards is whole blocks (2880 -> 3072). Padded channels have zero weights and
    biases, so SwiGLU(0) * (0 + 1) = 0 flows into zero down-projection columns: exact."""
    return BLOCK * max_tp * cdiv(size, BLOCK * max_tp)
