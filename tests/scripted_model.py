"""A real gpt-oss checkpoint whose greedy output is a chosen token sequence.

Built from a random tiny checkpoint by zeroing what every block writes into the residual stream
(attention output and expert down projections), so the last hidden state is the current token's
embedding; embeddings of the scripted tokens are orthogonal unit directions and the unembedding
maps direction i to token i+1 with a large logit. The result is a bigram model in the published
layout that the unmodified engine loads and serves: the way to drive Harmony tool calls and
channels through the whole cluster.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.checkpoint_writer import make_random_checkpoint
from pdserve.engine.config import preset


def make_scripted_checkpoint(out_dir: Path, script: list[int]) -> Path:
    """Greedy decoding from a prompt ending in script[0] yields script[1:] (tokens distinct)."""
    if len(set(script)) != len(script):
        raise ValueError("a bigram script needs distinct tokens")
    cfg = preset("tiny")
    if len(script) > cfg.hidden_size:
        raise ValueError("script longer than the hidden size")
    path = make_random_checkpoint(out_dir, cfg, seed=99)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    H = cfg.hidden_size
    for fname in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(path / fname))
        for name, t in tensors.items():
            if name.endswith(("o_proj.weight", "o_proj.bias", "down_proj_bias")) or name.endswith("down_proj_blocks"):
                tensors[name] = torch.zeros_like(t)
            elif name == "model.norm.weight":
                tensors[name] = torch.ones_like(t)
            elif name == "model.embed_tokens.weight":
                t = t * 0.01
                for i, tok in enumerate(script):
                    t[tok] = 0
                    t[tok, i] = 1.0
                tensors[name] = t
            elif name == "lm_head.weight":
                t = t * 0.01
                for i, nxt in enumerate(script[1:]):
                    t[nxt, i] = 60.0
                tensors[name] = t
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
    del H
    return path


def scripted_graph_runner(out_dir: Path, script: list[int]):
    """A bf16 ModelRunner on a scripted checkpoint with uncaptured decode graphs (batches of up to
    4), for the pipelined-decode tests of the engine and of the decode worker."""
    from pdserve.engine.cuda_graphs import DecodeGraphs
    from pdserve.engine.model_runner import ModelRunner

    r = ModelRunner(str(make_scripted_checkpoint(out_dir, script)), precision="bf16", num_kv_blocks=128)
    r.decode_graphs = DecodeGraphs(r.model, r.cache, 4, max_context=r.max_context, capture=False)
    return r
