"""YaRN rotary position encoding as gpt-oss uses it (half-split rotation).

Frequencies blend interpolation (positions / factor) and extrapolation per dimension with a linear
ramp between the beta_fast and beta_slow wavelengths of the original context; cos and sin are
scaled by the concentration 0.1 * ln(factor) + 1.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def yarn_inv_freq_and_concentration(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    d = cfg.head_dim
    base = cfg.rope_theta
    freq = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    factor = cfg.rope_scaling_factor
    if factor <= 1.0:
        return 1.0 / freq, 1.0
    concentration = 0.1 * math.log(factor) + 1.0
    d_half = d / 2
    ctx = cfg.initial_context_length
    low = d_half * math.log(ctx / (cfg.rope_ntk_beta * 2 * math.pi)) / math.log(base)
    high = d_half * math.log(ctx / (cfg.rope_ntk_alpha * 2 * math.pi)) / math.log(base)
    interpolation = 1.0 / (factor * freq)
    extrapolation = 1.0 / freq
    ramp = (torch.arange(d_half, dtype=torch.float32) - low) / (high - low)
    mask = 1 - ramp.clamp(0, 1)
    return interpolation * (1 - mask) + extrapolation * mask, concentration


class RotaryEmbedding:
    """Precomputed cos/sin table for every position up to the model's context."""

    def __init__(self, cfg: ModelConfig, device: torch.device, max_positions: int | None = None):
        inv_freq, conc = yarn_inv_freq_and_concentration(cfg)
        n = max_positions or cfg.max_position_embeddings
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos = (freqs.cos() * conc).to(device)
        self.sin = (freqs.sin() * conc).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> rotated, same dtype."""
        cos = self.cos[positions][:, None, :].to(x.dtype)
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
