"""Reading gpt-oss checkpoints in the layout users download (HF safetensors).

Expert weights come in one of three forms, told apart by config.json's quantization_config:
  mxfp4 (as published): `*_proj_blocks` uint8 [E, rows, cols/32, 16] + `*_proj_scales` uint8
        [E, rows, cols/32], rows = output dim (gate_up rows interleave glu/linear);
  bf16 (transformers' dequantised layout): `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H];
  fp8 (written by `pdserve convert`): `*_proj_fp8` e4m3 [E, out, in] + `*_proj_scale` float32
        128x128 block scales, intermediate padded (kernels.fp8.pad_intermediate).
Everything is memory-mapped and read per tensor, and only the slice a rank owns is read.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.kernels.fp8 import dequantize_weight_fp8, pad_intermediate, quantize_weight_fp8, quantize_weight_fp8_exact
from pdserve.kernels.experts import ExpertWeights
from pdserve.kernels.mxfp4 import MxExperts, dequantize_mxfp4

from .config import PROJECTION_PRECISIONS, ModelConfig
from .parallel import ShardSpec


class CheckpointError(RuntimeError):
    """The checkpoint is missing files or tensors, or a tensor has the wrong shape or dtype."""


class CheckpointReader:
    """Name -> tensor over a directory of safetensors files, memory-mapped."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self._handles: dict[str, object] = {}
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is corrupt: {e}") from None
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                for name in self._open(f.name).keys():
                    weight_map[name] = f.name
        self.weight_map: dict[str, str] = weight_map

    def _open(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{path} is listed in the index but missing")
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
            self._handles[fname] = h
        return h

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} not found in {self.dir}")
        return self._open(self.weight_map[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, *, shape: tuple[int, ...] | None = None, slices=None) -> torch.Tensor:
        """Read `name` (or `slices` of it, a tuple of python slices) after checking its shape."""
        h = self._handle(name)
        try:
            sl = h.get_slice(name)
            full = tuple(sl.get_shape())
            if shape is not None and full != tuple(shape):
                raise CheckpointError(f"tensor {name!r} has shape {full}, expected {tuple(shape)}")
            return sl[slices] if slices is not None else h.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r}: {e}") from None


@dataclass
class AttentionWeights:
    qkv_weight: torch.Tensor  # [(hq + 2 hkv) * D, H] local heads, fused
    qkv_bias: torch.Tensor
    o_weight: torch.Tensor  # [H, hq * D] local columns
    o_bias: torch.Tensor | None  # only on TP rank 0 (added once)
    sinks: torch.Tensor  # float32 [hq local]
    norm: torch.Tensor  # float32 [H]
    # attention precision fp8: both projections are e4m3 with these float32 128x128 block scales
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None


@dataclass
class MoEWeights:
    router_weight: torch.Tensor  # [E, H] (all experts: routing is replicated)
    router_bias: torch.Tensor
    experts: ExpertWeights | MxExperts  # MxExperts: precision mxfp4
    norm: torch.Tensor  # float32 [H]


@dataclass
class ModelWeights:
    embedding: torch.Tensor  # [V local, H]
    vocab_start: int
    layers: list[tuple[AttentionWeights, MoEWeights]]
    norm: torch.Tensor
    unembedding: torch.Tensor  # [V local, H]: bf16, or e4m3 with unembedding_scale (unembedding precision fp8)
    unembedding_scale: torch.Tensor | None = None  # float32 128x128 block scales of an e4m3 unembedding


def _rows(a: int, b: int) -> tuple[slice]:
    return (slice(a, b),)


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    *,
    shard: ShardSpec = ShardSpec(),
    precision: str = "bf16",
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    attention_precision: str = "bf16",
    unembedding_precision: str = "bf16",
) -> ModelWeights:
    """Read the weights rank `shard` owns, converting experts to `precision` (bf16 | fp8), or
    keeping MXFP4 experts as published (mxfp4: single rank, decode pools; see kernels.moe).
    `attention_precision` fp8 quantises this rank's QKV and O projection weights to e4m3 with
    128x128 block scales (amax / 448) on the target device; biases stay bf16. `unembedding_precision`
    fp8 does the same to this rank's vocabulary projection (lm_head).

    `progress`: a bar per layer on stderr (None: when stderr is a terminal, on rank 0 only).
    """
    if precision not in ("bf16", "fp8", "mxfp4"):
        raise ValueError(f"precision must be bf16, fp8 or mxfp4, not {precision!r}")
    for name, value in (("attention_precision", attention_precision), ("unembedding_precision", unembedding_precision)):
        if value not in PROJECTION_PRECISIONS:
            raise ValueError(f"{name} must be one of {PROJECTION_PRECISIONS}, not {value!r}")
    if precision == "mxfp4" and (cfg.experts_format != "mxfp4" or shard.world_size > 1):
        raise ValueError("precision mxfp4 keeps a checkpoint's MXFP4 experts on a single rank; this is "
                         f"a {cfg.experts_format} checkpoint on {shard.world_size} ranks")
    r = CheckpointReader(model_dir)
    dev = torch.device(device)
    H, D = cfg.hidden_size, cfg.head_dim
    bf16 = torch.bfloat16

    def put(t: torch.Tensor, dtype=bf16) -> torch.Tensor:
        return t.to(device=dev, dtype=dtype).contiguous()

    v0, v1 = shard.vocab_range(cfg.vocab_size)
    vrows = shard.vocab_shard_size(cfg.vocab_size)  # equal shards: the last one is zero-padded
    embedding = put(_pad_rows(r.get("model.embed_tokens.weight", shape=(cfg.vocab_size, H),
                                    slices=_rows(v0, v1)), vrows))
    unembedding = put(_pad_rows(r.get("lm_head.weight", shape=(cfg.vocab_size, H), slices=_rows(v0, v1)), vrows))
    unembedding_scale = None
    if unembedding_precision == "fp8":
        unembedding, unembedding_scale = quantize_weight_fp8(unembedding)
    norm = put(r.get("model.norm.weight", shape=(H,)), torch.float32)

    q0, q1 = shard.q_head_range(cfg.num_attention_heads)
    k0, k1 = shard.kv_head_range(cfg.num_key_value_heads)
    layers = []
    if progress is None:
        progress = sys.stderr.isatty() and shard.tp_rank == 0
    for i in tqdm(range(cfg.num_hidden_layers), desc=f"loading {Path(model_dir).name}",
                  unit="layer", file=sys.stderr, disable=not progress, leave=False,
                  mininterval=0):  # a layer takes seconds: show each (and a fast load still ends at N/N)
        p = f"model.layers.{i}."
        a = p + "self_attn."
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        qw = r.get(a + "q_proj.weight", shape=(hq * D, H), slices=_rows(q0 * D, q1 * D))
        kw = r.get(a + "k_proj.weight", shape=(hkv * D, H), slices=_rows(k0 * D, k1 * D))
        vw = r.get(a + "v_proj.weight", shape=(hkv * D, H), slices=_rows(k0 * D, k1 * D))
        qb = r.get(a + "q_proj.bias", shape=(hq * D,), slices=_rows(q0 * D, q1 * D))
        kb = r.get(a + "k_proj.bias", shape=(hkv * D,), slices=_rows(k0 * D, k1 * D))
        vb = r.get(a + "v_proj.bias", shape=(hkv * D,), slices=_rows(k0 * D, k1 * D))
        ow = r.get(a + "o_proj.weight", shape=(H, hq * D), slices=(slice(None), slice(q0 * D, q1 * D)))
        ob = r.get(a + "o_proj.bias", shape=(H,)) if shard.tp_rank == 0 else None
        attn = AttentionWeights(
            qkv_weight=put(torch.cat([qw, kw, vw])),
            qkv_bias=put(torch.cat([qb, kb, vb])),
            o_weight=put(ow),
            o_bias=put(ob) if ob is not None else None,
            sinks=put(r.get(a + "sinks", shape=(hq,), slices=_rows(q0, q1)), torch.float32),
            norm=put(r.get(p + "input_layernorm.weight", shape=(H,)), torch.float32),
        )
        E = cfg.num_local_experts
        moe = MoEWeights(
            router_weight=put(r.get(p + "mlp.router.weight", shape=(E, H))),
            router_bias=put(r.get(p + "mlp.router.bias", shape=(E,))),
            experts=_load_experts(r, p + "mlp.experts.", cfg, shard, precision, dev),
            norm=put(r.get(p + "post_attention_layernorm.weight", shape=(H,)), torch.float32),
        )
        if attention_precision == "fp8":
            attn.qkv_weight, attn.qkv_scale = quantize_weight_fp8(attn.qkv_weight)
            attn.o_weight, attn.o_scale = quantize_weight_fp8(attn.o_weight)
        layers.append((attn, moe))
    return ModelWeights(embedding, v0, layers, norm, unembedding, unembedding_scale)


def _load_experts(
    r: CheckpointReader, p: str, cfg: ModelConfig, shard: ShardSpec, precision: str, dev
) -> ExpertWeights | MxExperts:
    """This rank's experts [e0, e1) and its slice of their intermediate dimension.

    Source MXFP4/bf16 experts are split by real channels (I / moe_tp each) and, for FP8, each
    rank pads its slice to pad_intermediate(I) / moe_tp with zero channels. A converted FP8
    checkpoint is already padded and is split by whole 128-blocks. Both partitions compute the
    same sum over channels.
    """
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    e0, e1 = shard.expert_range(E)
    tp, tr = shard.moe_tp_size, shard.moe_tp_rank
    ex = slice(e0, e1)
    down_bias = r.get(p + "down_proj_bias", shape=(E, H), slices=(ex,)).float()
    if tr != 0:  # added once per token, by the first rank of the expert's TP group
        down_bias = torch.zeros_like(down_bias)
    if precision == "mxfp4":  # as published, one rank (load_weights checked)
        def get(name, shape):
            return r.get(p + name, shape=shape).to(dev).contiguous()

        from pdserve.kernels import moe

        experts = MxExperts(
            get("gate_up_proj_blocks", (E, 2 * I, H // 32, 16)), get("gate_up_proj_scales", (E, 2 * I, H // 32)),
            get("gate_up_proj_bias", (E, 2 * I)).float(), get("down_proj_blocks", (E, H, I // 32, 16)),
            get("down_proj_scales", (E, H, I // 32)), down_bias.to(dev).contiguous(),
        )
        # the CUDA decode kernel's block layout (the same bytes, bits moved within each word)
        return experts.to_packed() if dev.type == "cuda" and moe.MXFP4_CUDA_LAYOUT == "packed" else experts

    if cfg.experts_format == "fp8":
        Ip = pad_intermediate(I)
        i0, i1 = shard.split(Ip, tp, tr, "padded expert intermediate size")
        if i0 % 128:
            raise CheckpointError(f"FP8 expert shard at channel {i0} is not on a 128-block")
        gu_rows = slice(2 * i0, 2 * i1)
        b0, b1 = 2 * i0 // 128, 2 * i1 // 128
        gu = r.get(p + "gate_up_proj_fp8", shape=(E, 2 * Ip, H), slices=(ex, gu_rows))
        gus = r.get(p + "gate_up_proj_scale", slices=(ex, slice(b0, b1)))
        dn = r.get(p + "down_proj_fp8", shape=(E, H, Ip), slices=(ex, slice(None), slice(i0, i1)))
        dns = r.get(p + "down_proj_scale", slices=(ex, slice(None), slice(i0 // 128, i1 // 128)))
        gub = r.get(p + "gate_up_proj_bias", shape=(E, 2 * Ip), slices=(ex, gu_rows)).float()
        if precision == "fp8":
            return _to_device(ExpertWeights(gu, gub, dn, down_bias, gus, dns, e0), dev)
        gate_up = dequantize_weight_fp8(gu, gus, torch.bfloat16)
        down = dequantize_weight_fp8(dn, dns, torch.bfloat16)
        return _to_device(ExpertWeights(gate_up, gub, down, down_bias, first_expert=e0), dev)

    i0, i1 = shard.split(I, tp, tr, "expert intermediate size")
    gub = r.get(p + "gate_up_proj_bias", shape=(E, 2 * I), slices=(ex, slice(2 * i0, 2 * i1))).float()
    gate_up, down = [], []
    for e in range(e0, e1):  # one expert at a time bounds the conversion's memory
        g, d = _read_expert_bf16(r, p, cfg, e, i0, i1, device=dev)  # decoded on the target device
        gate_up.append(g)
        down.append(d)
    if precision == "bf16":
        w = ExpertWeights(torch.stack(gate_up), gub, torch.stack(down), down_bias, first_expert=e0)
        return _to_device(w, dev)
    ip_local = pad_intermediate(I) // tp
    gq, gs, dq, ds = [], [], [], []
    for g, d in zip(gate_up, down):
        q, s, _ = quantize_weight_fp8_exact(_pad_rows(g, 2 * ip_local))
        gq.append(q)
        gs.append(s)
        q, s, _ = quantize_weight_fp8_exact(_pad_rows(d.T, ip_local).T)
        dq.append(q)
        ds.append(s)
    gub = _pad_rows(gub.T, 2 * ip_local).T
    w = ExpertWeights(torch.stack(gq), gub, torch.stack(dq), down_bias, torch.stack(gs), torch.stack(ds), e0)
    return _to_device(w, dev)


def _read_expert_bf16(r: CheckpointReader, p: str, cfg: ModelConfig, e: int, i0: int = 0,
                     i1: int | None = None, device: torch.device | str = "cpu"):
    """Expert e's intermediate channels [i0, i1) as bf16: gate_up [2(i1-i0), H] (glu/linear
    interleaved), down [H, i1-i0]; MXFP4 decodes exactly. Reads only those channels (for the
    down projection, the 32-channel MXFP4 groups that hold them)."""
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    i1 = I if i1 is None else i1
    one = slice(e, e + 1)
    gu_rows = slice(2 * i0, 2 * i1)
    if cfg.experts_format == "mxfp4":
        g0, g1 = i0 // 32, -(-i1 // 32)
        gu_b = r.get(p + "gate_up_proj_blocks", shape=(E, 2 * I, H // 32, 16), slices=(one, gu_rows))
        gu_s = r.get(p + "gate_up_proj_scales", shape=(E, 2 * I, H // 32), slices=(one, gu_rows))
        groups = (one, slice(None), slice(g0, g1))
        dn_b = r.get(p + "down_proj_blocks", shape=(E, H, I // 32, 16), slices=groups)
        dn_s = r.get(p + "down_proj_scales", shape=(E, H, I // 32), slices=groups)
        gu_b, gu_s, dn_b, dn_s = (t.to(device) for t in (gu_b, gu_s, dn_b, dn_s))
        down = dequantize_mxfp4(dn_b, dn_s)[0][:, i0 - 32 * g0 : i1 - 32 * g0]
        return dequantize_mxfp4(gu_b, gu_s)[0], down.contiguous()
    # transformers' bf16 layout is (in, out): gate_up_proj [E, H, 2I], down_proj [E, I, H]
    gu = r.get(p + "gate_up_proj", shape=(E, H, 2 * I), slices=(one, slice(None), gu_rows))[0]
    dn = r.get(p + "down_proj", shape=(E, I, H), slices=(one, slice(i0, i1)))[0]
    gu, dn = gu.to(device), dn.to(device)
    return gu.T.to(torch.bfloat16).contiguous(), dn.T.to(torch.bfloat16).contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


def _to_device(w: ExpertWeights, dev) -> ExpertWeights:
    def mv(t):
        return None if t is None else t.to(dev).contiguous()

    return ExpertWeights(
        mv(w.gate_up), mv(w.gate_up_bias), mv(w.down), mv(w.down_bias),
        mv(w.gate_up_scale), mv(w.down_scale), w.first_expert,
    )
