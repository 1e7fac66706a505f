"""Writing checkpoints in the published HF layout: random ones for tests, converted FP8 ones.

Random checkpoints are built so that the MXFP4 and bf16-expert variants of one seed hold the same
model (the bf16 experts are the exact decoding of the MXFP4 ones), with magnitudes that make every
part of the forward pass matter: unit-variance projections, sinks of order one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pdserve.kernels.fp8 import pad_intermediate, quantize_weight_fp8_exact
from pdserve.kernels.mxfp4 import dequantize_mxfp4

from .checkpoint import CheckpointReader, _read_expert_bf16
from .config import ModelConfig

INDEX = "model.safetensors.index.json"
# Scale of what each block adds to the residual stream, relative to the stream (embeddings have
# unit variance). Trained models write small updates into a large stream; so do these, which
# keeps bf16 implementations within ~1e-2 of each other while every block still matters.
BLOCK_GAIN = 0.25


class ShardWriter:
    """Accumulates tensors and writes `model-0000i-of-0000n.safetensors` files of bounded size."""

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.dir = out_dir
        self.max = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += n
        self.total_bytes += n

    def flush(self) -> None:
        if not self.pending:
            return
        tmp = self.dir / f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def adopt(self, path: Path, names: list[str], nbytes: int) -> None:
        """Take a safetensors file written elsewhere (a worker's layer) as the next shard."""
        self.flush()
        os.replace(path, self.dir / f".shard-{len(self.files):05d}.safetensors")
        self.files.append(list(names))
        self.total_bytes += nbytes

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f".shard-{i:05d}.safetensors", self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def _prepare_out_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _check_spawnable_main() -> None:
    """Spawned workers re-import the caller's main script; a script read from standard input
    (`python -`) has none to re-import, and the pool would replace its failing workers forever."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not Path(main_file).is_file():
        raise RuntimeError(f"workers > 1 spawns processes that re-import the main script, and {main_file!r} is "
                           "not a file: run the caller from a file or with `python -c`, or pass workers=1")


def make_random_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    *,
    seed: int,
    experts: str = "mxfp4",
    max_shard_bytes: int = 2 << 30,
    progress: bool = False,
    workers: int = 1,
) -> Path:
    """Write a random gpt-oss checkpoint of shape `cfg` with experts as `mxfp4` or `bf16`.

    workers > 1 writes the layers in that many processes (a 120b-shaped checkpoint is 65 GB: one
    process needs ~10 minutes); each layer then draws from its own generator, so the weights of a
    seed differ from the single-process ones (and do not depend on the worker count)."""
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"experts must be mxfp4 or bf16, not {experts!r}")
    if workers > 1:
        _check_spawnable_main()
    out = _prepare_out_dir(out_dir)
    cfg = cfg.with_experts_format(experts)
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    w = ShardWriter(out, max_shard_bytes)
    w.add("model.embed_tokens.weight", _randn(g, cfg.vocab_size, H))
    layers = range(cfg.num_hidden_layers)
    if workers > 1:
        import multiprocessing as mp

        w.flush()
        jobs = [(cfg, i, seed, experts, str(out / f".layer-{i:05d}.safetensors")) for i in layers]
        with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for path, names, nbytes in tqdm(pool.imap(_write_random_layer, jobs), total=len(jobs),
                                            desc="layers", disable=not progress):
                w.adopt(Path(path), names, nbytes)
    else:
        for i in tqdm(layers, desc="layers", disable=not progress):
            for name, t in _random_layer(cfg, i, g, experts).items():
                w.add(name, t)
    w.add("model.norm.weight", (1.0 + torch.randn(H, generator=g) * 0.1).to(torch.bfloat16))
    w.add("lm_head.weight", _randn(g, cfg.vocab_size, H, std=H**-0.5))
    w.close()
    _write_configs(out, cfg)
    return out


def _randn(g: torch.Generator, *shape, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)


def _random_layer(cfg: ModelConfig, i: int, g: torch.Generator, experts: str) -> dict[str, torch.Tensor]:
    """Layer i's tensors, drawn from g in a fixed order."""
    H, D, E, I = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, torch.Tensor] = {}

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0):
        out[name + ".weight"] = _randn(g, out_f, in_f, std=gain * in_f**-0.5)
        out[name + ".bias"] = _randn(g, out_f, std=0.1 * gain)

    def norm(name: str):
        out[name] = (1.0 + torch.randn(H, generator=g) * 0.1).to(torch.bfloat16)

    def mxfp4(rows: int, cols: int, gain: float = 1.0):
        # uniform e2m1 codes; group exponents spread over 3 binades around gain/sqrt(cols)
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        centre = round(torch.log2(torch.tensor(gain * cols**-0.5 / 3.2)).item())
        scales = torch.randint(centre - 1, centre + 2, (E, rows, cols // 32), generator=g) + 127
        return blocks, scales.to(torch.uint8)

    p = f"model.layers.{i}."
    norm(p + "input_layernorm.weight")
    norm(p + "post_attention_layernorm.weight")
    linear(p + "self_attn.q_proj", hq * D, H)
    linear(p + "self_attn.k_proj", hkv * D, H)
    linear(p + "self_attn.v_proj", hkv * D, H)
    linear(p + "self_attn.o_proj", H, hq * D, gain=BLOCK_GAIN)
    out[p + "self_attn.sinks"] = _randn(g, hq)
    linear(p + "mlp.router", E, H)
    x = p + "mlp.experts."
    gu_b, gu_s = mxfp4(2 * I, H)
    dn_b, dn_s = mxfp4(H, I, gain=BLOCK_GAIN)
    out[x + "gate_up_proj_bias"] = _randn(g, E, 2 * I, std=0.1)
    out[x + "down_proj_bias"] = _randn(g, E, H, std=0.1 * BLOCK_GAIN)
    if experts == "mxfp4":
        for name, t in (("gate_up_proj_blocks", gu_b), ("gate_up_proj_scales", gu_s),
                        ("down_proj_blocks", dn_b), ("down_proj_scales", dn_s)):
            out[x + name] = t
    else:  # transformers' (in, out) layout of the same values
        out[x + "gate_up_proj"] = dequantize_mxfp4(gu_b, gu_s).transpose(1, 2).contiguous()
        out[x + "down_proj"] = dequantize_mxfp4(dn_b, dn_s).transpose(1, 2).contiguous()
    return out


def _write_random_layer(job) -> tuple[str, list[str], int]:
    """Worker: one layer from its own generator (seed, layer) into its own safetensors file."""
    cfg, i, seed, experts, path = job
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed * 1_000_003 + i + 1)
    tensors = {k: v.contiguous() for k, v in _random_layer(cfg, i, g, experts).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return path, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _write_configs(out: Path, cfg: ModelConfig, extra_quant: dict | None = None) -> None:
    d = cfg.to_hf_dict()
    if extra_quant:
        d["quantization_config"].update(extra_quant)
    (out / "config.json").write_text(json.dumps(d, indent=2))
    gen = {"bos_token_id": 199998, "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def convert_checkpoint(
    src: str | Path, dst: str | Path, *, max_shard_bytes: int = 2 << 30, progress: bool = True
) -> dict:
    """MXFP4 or bf16-expert checkpoint -> FP8 128x128 block-scaled experts (padded intermediate).

    Returns statistics: blocks converted and how many of them are bit-exact (power-of-two scale).
    """
    cfg = ModelConfig.load(src)
    if cfg.experts_format == "fp8":
        raise ValueError(f"{src} is already an FP8 checkpoint")
    reader = CheckpointReader(src)
    out = _prepare_out_dir(dst)
    I = cfg.intermediate_size
    Ip = pad_intermediate(I)
    w = ShardWriter(out, max_shard_bytes)
    expert_names = ("gate_up_proj", "down_proj")
    stats = {"blocks": 0, "exact_blocks": 0}
    names = sorted(reader.weight_map)
    for name in tqdm(names, desc="convert", disable=not progress):
        if ".mlp.experts." not in name:
            w.add(name, reader.get(name))
            continue
        prefix, leaf = name.split(".mlp.experts.")
        p = prefix + ".mlp.experts."
        if leaf == "gate_up_proj_bias":
            w.add(name, torch.nn.functional.pad(reader.get(name), (0, 2 * (Ip - I))))
        elif leaf == "down_proj_bias":
            w.add(name, reader.get(name))
        elif leaf in ("gate_up_proj_blocks", "gate_up_proj"):  # converts the whole layer
            gq, gs, dq, ds = [], [], [], []
            for e in range(cfg.num_local_experts):
                g, d = _read_expert_bf16(reader, p, cfg, e)  # [2I, H], [H, I]
                g = torch.nn.functional.pad(g.float(), (0, 0, 0, 2 * (Ip - I)))
                d = torch.nn.functional.pad(d.float(), (0, Ip - I))
                for t, qs, ss in ((g, gq, gs), (d, dq, ds)):
                    q, s, exact = quantize_weight_fp8_exact(t)
                    qs.append(q)
                    ss.append(s)
                    stats["blocks"] += exact.numel()
                    stats["exact_blocks"] += int(exact.sum())
            w.add(p + "gate_up_proj_fp8", torch.stack(gq))
            w.add(p + "gate_up_proj_scale", torch.stack(gs))
            w.add(p + "down_proj_fp8", torch.stack(dq))
            w.add(p + "down_proj_scale", torch.stack(ds))
        # the remaining expert tensors (scales, down blocks) were consumed above
        elif leaf not in ("gate_up_proj_scales", "down_proj_blocks", "down_proj_scales") + expert_names:
            raise ValueError(f"unexpected expert tensor {name}")
    w.close()
    _write_configs(out, cfg.with_experts_format("fp8"), {"padded_intermediate_size": Ip})
    for f in Path(src).iterdir():  # tokenizer and other side files travel along
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX, "generation_config.json"):
            shutil.copy2(f, out / f.name)
    return stats
