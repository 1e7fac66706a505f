"""Same-run peer for the decode step: OpenAI's own Triton implementation of gpt-oss
(`gpt_oss.triton`, from the `gpt-oss` package), on the very weights pdserve serves.

It is built with its own loader (`Transformer.from_checkpoint`: MXFP4 experts decoded by
`gpt_oss.torch.weights.Checkpoint`, re-quantised by `triton_kernels` into the Hopper MX layout),
reading pdserve's checkpoint (the published Hugging Face layout) through `hf_layout_checkpoint`,
which answers OpenAI's original tensor names (`block.N.attn.qkv.weight`, ...) from it. Its decode
step is timed the way its `TokenGenerator` runs it: one CUDA graph of the model over a KV cache
(`Cache`), replayed per token, greedy token read back by the host and written into the graph's
input. The generator holds one sequence; the same graph over a cache of B rows decodes B sequences
of equal length at once (the cache keeps one position for all rows), which is how batch 64 is
measured. Its cache is a dense [B, capacity] buffer and its decode attention reads all of it, so
the capacity is sized to the measured context plus the steps taken.

Needs `gpt-oss` (`pip install gpt-oss`) and `triton_kernels` (python/triton_kernels of the Triton
repository, the version matching the installed Triton) importable.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

INSTALL_HINT = ("needs OpenAI's Triton implementation: `pip install gpt-oss` and put `triton_kernels` "
                "(python/triton_kernels of the Triton repository, matching your Triton) on PYTHONPATH")


def missing() -> str | None:
    """None when the peer can be imported, else one line saying what to install."""
    try:
        import triton_kernels  # noqa: F401
        import gpt_oss.triton.model  # noqa: F401
    except ImportError as e:
        return f"{INSTALL_HINT} (import failed: {e})"
    return None


def reference_config(cfg):
    """OpenAI's ModelConfig for pdserve's `cfg` (engine.config.ModelConfig)."""
    from gpt_oss.torch.model import ModelConfig

    alternating = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers))
    if cfg.sliding_window and tuple(cfg.layer_types) != alternating:
        raise ValueError("OpenAI's implementation slides the window on even layers only; "
                         f"this checkpoint's layer types are {cfg.layer_types}")
    return ModelConfig(
        num_hidden_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts,
        experts_per_token=cfg.experts_per_token, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        swiglu_limit=cfg.swiglu_limit, head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        sliding_window=cfg.sliding_window, initial_context_length=cfg.initial_context_length,
        rope_theta=cfg.rope_theta, rope_scaling_factor=cfg.rope_scaling_factor,
        rope_ntk_alpha=cfg.rope_ntk_alpha, rope_ntk_beta=cfg.rope_ntk_beta,
    )


_TOP = {"embedding.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
        "unembedding.weight": "lm_head.weight"}
_BLOCK = {"attn.norm.scale": "input_layernorm.weight", "attn.sinks": "self_attn.sinks",
          "attn.out.weight": "self_attn.o_proj.weight", "attn.out.bias": "self_attn.o_proj.bias",
          "mlp.norm.scale": "post_attention_layernorm.weight",
          "mlp.gate.weight": "mlp.router.weight", "mlp.gate.bias": "mlp.router.bias",
          "mlp.mlp1_bias": "mlp.experts.gate_up_proj_bias", "mlp.mlp2_bias": "mlp.experts.down_proj_bias",
          "mlp.mlp1_weight.blocks": "mlp.experts.gate_up_proj_blocks",
          "mlp.mlp1_weight.scales": "mlp.experts.gate_up_proj_scales",
          "mlp.mlp2_weight.blocks": "mlp.experts.down_proj_blocks",
          "mlp.mlp2_weight.scales": "mlp.experts.down_proj_scales",
          # bf16-expert checkpoints: transformers' [E, in, out], transposed on read
          "mlp.mlp1_weight": "mlp.experts.gate_up_proj", "mlp.mlp2_weight": "mlp.experts.down_proj"}


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face tensors that make OpenAI's tensor `name` (qkv: q, k and v concatenated)."""
    if name in _TOP:
        return (_TOP[name],)
    m = re.fullmatch(r"block\.(\d+)\.(.+)", name)
    if m:
        p, leaf = f"model.layers.{m[1]}.", m[2]
        if leaf in _BLOCK:
            return (p + _BLOCK[leaf],)
        if leaf in ("attn.qkv.weight", "attn.qkv.bias"):
            kind = leaf.rsplit(".", 1)[1]
            return tuple(f"{p}self_attn.{x}_proj.{kind}" for x in "qkv")
    raise KeyError(f"no Hugging Face tensor for OpenAI's {name!r}")


def hf_layout_checkpoint(path: str | Path, device: torch.device):
    """An OpenAI `Checkpoint` (gpt_oss.torch.weights) over a checkpoint in the HF layout: its
    MXFP4 decoding and name map are OpenAI's own; only the tensor lookup is translated."""
    from gpt_oss.torch.weights import Checkpoint

    from pdserve.engine.checkpoint import CheckpointReader

    class Names:
        """OpenAI's names held by the checkpoint (the base class asserts membership)."""

        def __init__(self, reader):
            self.reader = reader

        def __contains__(self, name: str) -> bool:
            try:
                return all(n in self.reader for n in hf_names(name))
            except KeyError:
                return False

    class HfLayoutCheckpoint(Checkpoint):
        def __init__(self, path, device):  # no directory scan: the reader has the index
            self.device_str = device.type if device.index is None else f"{device.type}:{device.index}"
            self.reader = CheckpointReader(path)
            self.tensor_name_to_file = Names(self.reader)

        def get(self, name: str) -> torch.Tensor:
            bf16_expert = re.fullmatch(r"block\.\d+\.mlp\.mlp[12]_weight", name)
            if bf16_expert and hf_names(name)[0] in self.reader:
                return self._get_tensor(name).transpose(1, 2).contiguous()
            return super().get(name)

        def _get_tensor(self, name: str) -> torch.Tensor:
            parts = [self.reader.get(n) for n in hf_names(name)]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)
            return t.to(self.device_str)

    return HfLayoutCheckpoint(path, device)


@torch.inference_mode()
def load(ckpt: str | Path, cfg, device: str = "cuda"):
    """gpt_oss.triton's Transformer through its own from_checkpoint, on pdserve's files."""
    from unittest import mock

    import gpt_oss.triton.model as tm

    with mock.patch.object(tm, "Checkpoint", hf_layout_checkpoint):
        return tm.Transformer.from_checkpoint(str(ckpt), config=reference_config(cfg), device=device)


@torch.inference_mode()
def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one prompt (no cache: the whole prompt at once)."""
    dev = model.embedding.weight.device
    return model(torch.tensor(ids, dtype=torch.int32, device=dev)[None, :])[0]


def prefill_chunks(context: int, batch: int, max_rows: int = 8192) -> list[int]:
    """Chunk lengths for a prefill of `batch` x `context` tokens: about max_rows tokens per call
    (bounding the [rows, vocab] logits the model always computes), and at least 64 per chunk
    when context allows, since below 64 query tokens the peer also runs its reference attention
    and asserts the two agree."""
    per = max(128, (max_rows // batch) // 64 * 64)
    n = -(-context // per)
    return [context // n + (1 if i < context % n else 0) for i in range(n)]


def _sync() -> None:
    torch.cuda.synchronize()


@torch.inference_mode()
def time_decode(model, batch: int, context: int, steps: int, generator: torch.Generator,
                warmup: int = 3) -> dict:
    """Prefill `batch` random prompts of `context` tokens, then time `steps` decode steps as its
    TokenGenerator runs them (graph replay, greedy ids read by the host, written back into the
    graph's input), then `steps` replays back to back (the GPU's time alone)."""
    import gpt_oss.triton.model as tm

    cfg, dev = model.config, model.embedding.weight.device
    capacity = context + warmup + 2 * steps + 1
    caches = [tm.Cache(batch, capacity, cfg.num_key_value_heads, device=dev) for _ in model.block]
    token = torch.zeros((batch, 1), dtype=torch.int32, device=dev)
    model(token, caches=caches)  # warm-up: compiles the decode kernels (as TokenGenerator does)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(token, caches=caches)
    for c in caches:
        c.reset()
    prompts = torch.randint(0, cfg.vocab_size, (batch, context), generator=generator, dtype=torch.int32).to(dev)
    start = 0
    for n in prefill_chunks(context, batch):
        last = model(prompts[:, start:start + n], caches=caches)[:, -1]
        start += n
    ids = last.argmax(-1).tolist()
    del last

    def step() -> None:
        nonlocal ids
        token.copy_(torch.tensor(ids, dtype=torch.int32)[:, None])
        graph.replay()
        ids = logits[:, -1].argmax(-1).tolist()

    for _ in range(warmup):
        step()
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    step_s = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    _sync()
    replay_s = (time.perf_counter() - t) / steps
    return {"batch": batch, "context": context, "cache_tokens": capacity, "step_ms": step_s * 1e3,
            "replay_ms": replay_s * 1e3, "tok_s_total": batch / step_s}


def measure(ckpt: str | Path, cfg, batches: list[int], context: int, steps: int, check_ids: list[int],
            pdserve_logits: torch.Tensor, pdserve_step_ms: dict[int, float], generator: torch.Generator,
            device: str = "cuda") -> dict:
    """Load the peer, check its logits against pdserve's on the same prompt, time its decode per
    batch size, free its memory. pdserve_step_ms: pdserve's engine step per batch, same run."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        impl = f"gpt_oss.triton (gpt-oss {version('gpt-oss')})"
    except PackageNotFoundError:
        impl = "gpt_oss.triton"
    torch.cuda.empty_cache()
    t = time.perf_counter()
    model = load(ckpt, cfg, device)
    _sync()
    load_s = time.perf_counter() - t
    theirs = prompt_logits(model, check_ids).to(pdserve_logits.device)
    ours = pdserve_logits.float()
    rel = float((theirs.double() - ours.double()).norm() / ours.double().norm())
    agree = float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())
    del theirs
    decode = {}
    for b in batches:
        d = time_decode(model, b, context, steps, generator)
        d["pdserve_step_ms"] = pdserve_step_ms.get(b)
        d["pdserve_over_peer"] = d["step_ms"] / d["pdserve_step_ms"] if d["pdserve_step_ms"] else None
        decode[b] = d
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return {"impl": impl, "load_s": load_s, "check_tokens": len(check_ids), "logits_rel_l2_vs_pdserve": rel,
            "argmax_agreement_vs_pdserve": agree, "decode": decode}


def table(peer: dict) -> list[str]:
    """Markdown rows: per batch size the peer's step, pdserve's, and pdserve's throughput over the
    peer's (> 1: pdserve faster)."""
    lines = ["| batch | context | peer step (ms) | peer replay alone (ms) | peer tok/s | pdserve step (ms) | "
             "pdserve tok/s | pdserve / peer (tok/s) |", "|---|---|---|---|---|---|---|---|"]
    for d in peer["decode"].values():
        ours = d["pdserve_step_ms"]
        lines.append(f"| {d['batch']} | {d['context']} | {d['step_ms']:.2f} | {d['replay_ms']:.2f} | "
                     f"{d['tok_s_total']:.0f} | " + (f"{ours:.2f} | {d['batch'] / ours * 1e3:.0f} | "
                                                     f"{d['pdserve_over_peer']:.2f}x |" if ours else "- | - | - |"))
    return lines
