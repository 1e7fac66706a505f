"""The decode step's CUDA graph under different settings, timed interleaved in one process.

Each setting (environment variables read when kernels are launched, model attributes and module
constants read when a graph is captured) gets its own DecodeGraphs of the same runner and the same
running batch; rounds replay each setting's graph back to back in turn, so clock and thermal drift
fall on every setting alike. Reports the median replay per setting and its ratio to the first.
Settings: programmatic dependent launch (kernels/pdl.py) off, then on; then also one token's QKV
GEMV + RoPE + KV write in one launch (`GptOssModel.fuse_qkv_rope`); the decode attention of
2026-12-01 (XQA for full layers, the default Triton tiling for windowed ones), then with the Triton
kernel for full layers too; reads ahead of the PDL wait (kernels/pdl.py) in none, some or all of the
kernels that have them (the per-pair MXFP4 gate/up's token rows last); the MXFP4 kernels' bias read
after their sums ("late bias"); the O projection through the Triton GEMV rather than the staged one
("O triton gemv"); per-pair MXFP4 down's sum over a token's pairs through global memory rather than
a thread-block cluster ("down counters"); the Triton router rather than the cluster one ("router
triton"); the attention projections in FP8 through the staged FP8 GEMVs or the Triton FP8 linear
("attention fp8", "attention fp8 triton"), the former with four commit groups a warp ("attention fp8
four groups"), up to 8 tokens ("attention fp8 gemv to 8"), or with the QKV launched after the norm's
PDL wait rather than at its start ("attention fp8 qkv launch late"); the vocabulary projection in FP8
through the streaming FP8 GEMV ("unembedding fp8", "attention+unembedding fp8") or in bf16 through
cuBLAS rather than the bf16 GEMV ("unembedding cublas"); windowed layers' decode
attention in 2 or 4 splits; the engine's defaults; with --mma-config, the defaults with another
launch shape of the MXFP4 mma kernels; with --gemv-configs, the defaults with another launch shape
of one token's bf16 GEMVs (QKV + RoPE, O); with --ablate, the defaults (or --ablate-on's setting)
with one piece of every layer (norms, QKV, attention, O projection, router, MoE) taken out: the
marginal cost of each. --fp8: every setting with FP8 attention and vocabulary projections;
--timeline: each setting's step as a per-kernel timeline of a layer (bench/step_timeline.py);
--trace: at up to cuda_gemv_fp8.MAX_TOKENS tokens with --fp8, each setting captured once more with the
timing build of the FP8 QKV and O launches, CTA by CTA (bench/projection_trace.py);
--controls N: the first setting captured N more times, timed like the others, so that the run
reports how far captures of the very same kernels land apart (their spread; on an H200 up to 1.5 % of
a 20b step at four tokens, 2026-12-04): a difference inside it is no evidence for a setting.

    python bench/launch_ab.py --ckpt DIR [--precision mxfp4] [--batches 1,16,64] [--context 1024]
        [--settings "pdl off,default"] [--mma-config 4,2,2/4,4,2] [--pair-configs "4,1,2/4,4,2;..."]
        [--resident-gate-up "4,4,3,4,1;..."] [--resident-max-tokens "1;3@4,4,3,3,1"]
        [--gemv-configs "2880x4096:4,512,2,4;..."] [--ablate norms,qkv,attention,o,router,moe] [--ablate-on SETTING]
        [--rounds 15] [--replays 20] [--fp8] [--timeline] [--trace] [--controls 1] [--layers 36 [--alias-layers]] [--kv-blocks 8192]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench import projection_trace, step_timeline  # noqa: E402
from pdserve.bench.kernels import time_it  # noqa: E402
from pdserve.bench.repeated_layers import alias_repeated, repeated_layers  # noqa: E402
from pdserve.engine.config import ModelConfig  # noqa: E402
from pdserve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.sampling import SamplingParams  # noqa: E402
from pdserve.kernels import (  # noqa: E402
    cuda_decode_attention, cuda_gemv_fp8, cuda_gemv_staged, cuda_moe_mxfp4, cuda_router, flashinfer_attention, moe,
    triton_bf16_gemv, triton_decode_attention, triton_norm, triton_router,
)

# reads ahead of the PDL wait (kernels/pdl.py), per kernel
EARLY = {
    "attention": (triton_decode_attention, "EARLY_KV"),
    "router": (triton_router, "EARLY_WEIGHTS"),
    "down": (cuda_moe_mxfp4, "EARLY_DOWN"),
    "gemv": (triton_bf16_gemv, "EARLY_WEIGHTS"),
    "gate/up x": (cuda_moe_mxfp4, "EARLY_X"),
    "norm": (triton_norm, "EARLY_READS"),
}


def _early(*kernels: str) -> dict:
    """Module constants: reads ahead of the PDL wait in these kernels only."""
    return {key: name in kernels for name, key in EARLY.items()}


def _setting(constants: dict | None = None, pdl: bool = True, **attrs) -> tuple:
    """(environment, GptOssModel attributes, {(module, constant): value}) at capture; what a
    setting does not name keeps the engine's value (every change is undone after its capture), except
    that one token's QKV + RoPE is fused unless `fuse_qkv_rope=False`."""
    return {"PDSERVE_PDL": "1" if pdl else "0"}, {"fuse_qkv_rope": True, **attrs}, constants or {}


def with_controls(settings: dict, n: int) -> tuple[dict, dict[str, str]]:
    """The settings with the first one repeated n more times ("<first> (control k)"), and which
    setting each control repeats."""
    first = next(iter(settings))
    controls = {f"{first} (control {k})": first for k in range(1, n + 1)}
    return {**settings, **{c: settings[first] for c in controls}}, controls


def control_spread(medians: dict[str, float], controls: dict[str, str]) -> tuple[float, float] | None:
    """(lowest, highest) median of the first setting's captures (itself and its controls) over the
    first's: how far identical kernels land apart in this run; None without controls."""
    if not controls:
        return None
    first = next(iter(controls.values()))
    ratios = [medians[n] / medians[first] for n in [first, *controls]]
    return min(ratios), max(ratios)


def _full_layers(min_keys: int, max_splits: int) -> dict:
    return {(triton_decode_attention, "FULL_LAYERS"): triton_decode_attention.DecodeConfig(
        block_n=128, min_keys=min_keys, max_splits=max_splits, combine_splits=max_splits)}


def _full_cluster(cfg) -> dict:
    """The cluster decode attention's full layers in this shape at every batch it serves."""
    return {(cuda_decode_attention, "FULL_LAYERS"): cfg, (cuda_decode_attention, "FULL_LAYERS_FEW"): None}


ATTENTION_12_01 = {
    (flashinfer_attention, "_TRITON_MAX_BATCH"): {"full": 0, "window": 64},
    (triton_decode_attention, "WINDOWED_LAYERS"): triton_decode_attention.DecodeConfig(),
    **_early(),
}

SETTINGS = {
    "pdl off": _setting(pdl=False, fuse_qkv_rope=False),
    "pdl on": _setting(fuse_qkv_rope=False),
    "pdl on, qkv+rope": _setting(),
    "attention 12-01": _setting(ATTENTION_12_01),
    "full layers triton": _setting({**ATTENTION_12_01,
                                    (flashinfer_attention, "_TRITON_MAX_BATCH"): {"full": 16, "window": 64}}),
    "no early reads": _setting(_early()),
    "early attention": _setting(_early("attention")),
    "early attention+router": _setting(_early("attention", "router")),
    "early attention+router+down": _setting(_early("attention", "router", "down")),
    "no early gate/up x": _setting({EARLY["gate/up x"]: False}),
    "no early down": _setting({EARLY["down"]: False}),
    # the residual add + RMSNorm reading its weights and the residual after its wait, with the block's output
    "norm reads late": _setting({EARLY["norm"]: False}),
    # the MXFP4 kernels' bias (and down's routing weights) requested after the sums, not with the weights
    "late bias": _setting({(cuda_moe_mxfp4, "EARLY_BIAS"): False}),
    # the attention output projection through the Triton bf16 GEMV, not the one that stages its
    # weights in shared memory during the attention
    "O triton gemv": _setting({(cuda_gemv_staged, "MAX_TOKENS"): 0}),
    # per-pair MXFP4 down adds a token's pairs through float32 partials and an arrival counter in
    # global memory, not inside a thread-block cluster
    "down counters": _setting({(cuda_moe_mxfp4, "CLUSTER_SUM"): False}),
    # per-pair MXFP4 gate/up skips the zero B loads by a predicate a K step (offsets rebuilt every
    # step), not reading them from a row of zeros (MmaConfig's zero_row)
    "gate/up predicated B": _setting({(cuda_moe_mxfp4, "PAIR_CONFIG"): cuda_moe_mxfp4.MmaConfig(
        gate_up=(4, 4, 3), down=cuda_moe_mxfp4.PAIR_CONFIG.down)}),
    # the router through the Triton kernel (partial logits meet in global memory), not the clusters
    "router triton": _setting({(cuda_router, "ENABLED"): False}),
    # the cluster router with 12 CTAs a token (not CLUSTER's 8); launched at the start of the norm before it
    # (not after that norm's wait); both
    "router 12 CTAs": _setting({(cuda_router, "CLUSTERS"): {32: 12, 128: 12}}),
    "router launch early": _setting(early_router_launch=True),
    "router launch early + 12 CTAs": _setting({(cuda_router, "CLUSTERS"): {32: 12, 128: 12}},
                                              early_router_launch=True),
    # the same with gate/up one CTA a tile (mx_gate_up), not the resident grid sized to what empty SMs hold
    "router launch early + gate/up a CTA a tile": _setting({(cuda_moe_mxfp4, "RESIDENT_GATE_UP"): None},
                                                           early_router_launch=True),
    # the attention output projection (where it is the FP8 or the staged bf16 GEMV, which read only weights
    # ahead of their wait) launched at the cluster decode attention's start, not after its wait; with the
    # router launched early too
    "O launch early": _setting(early_o_launch=True),
    "O launch early + router launch early": _setting(early_o_launch=True, early_router_launch=True),
    # (with FP8 attention projections) the MoE's down launch requesting the next layer's QKV weights into L2; or
    # gate/up requesting them and down the next O weights
    "down prefetches next QKV": _setting(prefetch_next={"down": "qkv"}),
    "gate/up prefetches next QKV + down next O": _setting(prefetch_next={"gate_up": "qkv", "down": "o"}),
    # the MXFP4 experts' weights read with L2's evict-first policy, alone and with the prefetches above (whose lines
    # they then leave in L2)
    "experts evict first": _setting({(cuda_moe_mxfp4, "EVICT_FIRST"): True}),
    "down prefetches next QKV + experts evict first": _setting({(cuda_moe_mxfp4, "EVICT_FIRST"): True},
                                                              prefetch_next={"down": "qkv"}),
    "gate/up prefetches next QKV + down next O + experts evict first": _setting(
        {(cuda_moe_mxfp4, "EVICT_FIRST"): True}, prefetch_next={"gate_up": "qkv", "down": "o"}),
    # with FP8 attention projections: the FP8 QKV GEMV launched after the norm's PDL wait, as every
    # other kernel, not at the norm's start (kernels/pdl.py)
    "attention fp8 qkv launch late": _setting(early_qkv_launch=False),
    # the decode attention through the Triton split-KV kernel (partials folded through global memory and
    # an arrival counter), not the cluster kernel that folds them in distributed shared memory; or the
    # cluster kernel for full layers only, or windowed ones only; or with spare clusters for long
    # requests (4 at one request, 2 at two), or with 4 blocks of shared memory a CTA, not 2
    "attention triton": _setting({(cuda_decode_attention, "ENABLED"): False}),
    "cluster attention full only": _setting({(cuda_decode_attention, "WINDOWED_LAYERS"):
                                             cuda_decode_attention.ClusterConfig(cluster=1, stages=1, max_rows=0)}),
    "cluster attention windowed only": _setting(_full_cluster(cuda_decode_attention.ClusterConfig(8, 2, max_rows=0))),
    "cluster attention spare clusters": _setting(_full_cluster(cuda_decode_attention.ClusterConfig(8, 2, 4, max_groups=4))),
    "cluster attention 4 stages": _setting(_full_cluster(cuda_decode_attention.ClusterConfig(8, 4, 4))),
    # full layers' page-table entries requested 2 or 3 blocks ahead of their copies, not 1
    "cluster attention entries 2 ahead": _setting(_full_cluster(cuda_decode_attention.ClusterConfig(8, 2, 4, lookahead=2))),
    "cluster attention entries 3 ahead": _setting(_full_cluster(cuda_decode_attention.ClusterConfig(8, 2, 4, lookahead=3))),
    # full layers at one and two requests in clusters of 8 CTAs, as from three (not of 16); or in
    # clusters of 16 at one request only; or with 3 or 4 blocks of shared memory a CTA (not 2)
    "cluster attention 8 at every batch": _setting(_full_cluster(cuda_decode_attention.FULL_LAYERS)),
    "cluster attention 16 at one request only": _setting({(cuda_decode_attention, "FULL_LAYERS_FEW"):
                                                          cuda_decode_attention.ClusterConfig(16, 2, 1)}),
    "cluster attention 16x3": _setting({(cuda_decode_attention, "FULL_LAYERS_FEW"):
                                        cuda_decode_attention.ClusterConfig(16, 3, 2)}),
    "cluster attention 16x4": _setting({(cuda_decode_attention, "FULL_LAYERS_FEW"):
                                        cuda_decode_attention.ClusterConfig(16, 4, 2)}),
    # full layers at one and two requests with one block of shared memory a CTA (about 43 KB, not 76); the QKV
    # launch in CTAs of 16 rows (cuda_gemv_fp8.QKV_ROWS: three an SM, not up to six of 8 rows), alone and with
    # the one-block attention, which then finds room beside them on every SM
    "cluster attention 16x1": _setting({(cuda_decode_attention, "FULL_LAYERS_FEW"):
                                        cuda_decode_attention.ClusterConfig(16, 1, 2)}),
    "qkv 16 rows": _setting({(cuda_gemv_fp8, "QKV_ROWS"): 16}),
    "qkv 16 rows + attention 16x1": _setting({(cuda_gemv_fp8, "QKV_ROWS"): 16, (cuda_decode_attention, "FULL_LAYERS_FEW"):
                                              cuda_decode_attention.ClusterConfig(16, 1, 2)}),
    # full layers in splits of at least 256 keys (the tiling until 2026-12-04; the engine's now: splits of
    # one 128-key block, all of a split's keys read ahead of the wait), or of one block up to 64 splits
    "full 256-key splits": _setting(_full_layers(256, 32)),
    "full 128-key splits x64": _setting(_full_layers(128, 64)),
    # windowed layers (128 keys) in 2 or 4 splits of 64 / 32 keys, 4 warps, not one 128-key block of 8 warps
    "windowed 2 splits": _setting({(triton_decode_attention, "WINDOWED_LAYERS"): triton_decode_attention.DecodeConfig(
        block_n=64, min_keys=64, num_warps=4)}),
    "windowed 4 splits": _setting({(triton_decode_attention, "WINDOWED_LAYERS"): triton_decode_attention.DecodeConfig(
        block_n=32, min_keys=32, num_warps=4)}),
    # the attention projections' weights in FP8 (128x128 block scales, as --attention-precision fp8
    # loads them): through the FP8 GEMVs that stage their weights (QKV with its RoPE epilogue), or
    # through the Triton FP8 linear
    "attention fp8": _setting(),
    "attention fp8 triton": _setting({(cuda_gemv_fp8, "MAX_TOKENS"): 0}),
    # the FP8 GEMVs up to their 8 tokens, not up to cuda_gemv_fp8.MAX_TOKENS
    "attention fp8 gemv to 8": _setting({(cuda_gemv_fp8, "MAX_TOKENS"): cuda_gemv_fp8.MAX_M}),
    # the FP8 GEMVs summing each quarter of a warp's weight bytes as soon as it has landed (four commit
    # groups), not once all have
    "attention fp8 four groups": _setting({(cuda_gemv_fp8, "GROUPS"): 4, (cuda_gemv_fp8, "EARLY_GROUPS"): 4}),
    # the FP8 GEMVs' weight copies all requested ahead of the wait in one group (the default until 2026-12-07), or
    # other shares of them right after it, behind the token rows' loads (cuda_gemv_fp8.GROUPS, EARLY_GROUPS; the
    # default: half, in two groups)
    "fp8 gemv all copies before the wait": _setting({(cuda_gemv_fp8, "GROUPS"): 1, (cuda_gemv_fp8, "EARLY_GROUPS"): 1}),
    "fp8 gemv a quarter of the copies after x": _setting({(cuda_gemv_fp8, "GROUPS"): 4,
                                                          (cuda_gemv_fp8, "EARLY_GROUPS"): 3}),
    "fp8 gemv half the copies after x in four groups": _setting({(cuda_gemv_fp8, "GROUPS"): 4,
                                                               (cuda_gemv_fp8, "EARLY_GROUPS"): 2}),
    "fp8 gemv three quarters of the copies after x": _setting({(cuda_gemv_fp8, "GROUPS"): 4,
                                                               (cuda_gemv_fp8, "EARLY_GROUPS"): 1}),
    # grouped MXFP4 launches with each group's sum rescaled in float32 (2 pairs an mma), not with the
    # scales folded into the decoded weights (8 pairs an mma), and from 64 tokens the Triton grouped
    # kernels: as before the folded launches
    "mxfp4 unfolded": _setting({(cuda_moe_mxfp4, "FOLD_CONFIG"): None}),
    # the folded launches decoding in bf16 (MX_FOLD 1), not in f16 where the experts allow it
    "mxfp4 fold bf16": _setting({(cuda_moe_mxfp4, "FOLD_CONFIG"): dataclasses.replace(
        cuda_moe_mxfp4.FOLD_CONFIG, fold_f16=False)}),
    # folded launches from 16 or 32 tokens, not from cuda_moe_mxfp4.FOLD_FROM_TOKENS (every grouped launch); or
    # up to 128 tokens, not to kernels.moe.MXFP4_MMA_FOLDED_MAX_TOKENS (the Triton grouped kernels above)
    "mxfp4 fold from 16": _setting({(cuda_moe_mxfp4, "FOLD_FROM_TOKENS"): 16}),
    "mxfp4 fold from 32": _setting({(cuda_moe_mxfp4, "FOLD_FROM_TOKENS"): 32}),
    # two and three tokens grouped (and folded), not per pair (kernels.moe.MXFP4_MMA_GROUPED_FROM)
    "mxfp4 grouped from 2": _setting({(moe, "MXFP4_MMA_GROUPED_FROM"): 2, (cuda_moe_mxfp4, "FOLD_FROM_TOKENS"): 2}),
    "mxfp4 fold to 128": _setting({(moe, "MXFP4_MMA_FOLDED_MAX_TOKENS"): 128}),
    # the vocabulary projection's weights in FP8 (as --unembedding-precision fp8 loads them), alone and
    # with FP8 attention projections; its bf16 weights through cuBLAS at every batch (before 2026-12-04)
    "unembedding fp8": _setting(),
    "attention+unembedding fp8": _setting(),
    "unembedding cublas": _setting({(triton_bf16_gemv, "FASTER_THAN_CUBLAS_UP_TO"): {
        k: v for k, v in triton_bf16_gemv.FASTER_THAN_CUBLAS_UP_TO.items() if k != (201088, 2880)}}),
    "default": _setting(),
}
FP8_ATTENTION = ("attention fp8", "attention fp8 triton", "attention fp8 gemv to 8", "attention fp8 four groups",
                 "attention fp8 qkv launch late", "attention+unembedding fp8")  # capture with FP8 QKV and O
FP8_UNEMBEDDING = ("unembedding fp8", "attention+unembedding fp8")  # capture with an FP8 vocabulary projection


ABLATIONS = ("norms", "qkv", "attention", "o", "router", "moe", "gate_up", "down")
_SKIPPED = object()  # stands for an MXFP4 mma kernel taken out: its launch is skipped
_ABSENT = object()  # an attribute a patch added (a method shadowed on the instance): undone by deleting it


def _ablation(runner: ModelRunner, piece: str, rows: int) -> list[tuple[object, str, object]]:
    """Patches (object, attribute, value) that take one piece of every layer out of the captured
    step, launching nothing in its place (a buffer of the right shape made here, or the piece's
    input, stands for its output): the replay's change is that piece's marginal cost on the step's
    critical path. The logits are meaningless; every routing stays a valid one, except that without
    one of the MXFP4 mma kernels ("gate_up", "down": the per-pair and grouped launches of
    kernels/cuda_moe_mxfp4.py) the MoE's output is garbage that the router may turn into no valid
    routing: take those together with "router" ("router+down"). Pieces join with "+"."""
    import pdserve.engine.model as model_mod

    if "+" in piece:
        return [p for part in piece.split("+") for p in _ablation(runner, part, rows)]
    if piece in ("gate_up", "down"):
        kernels, launch = cuda_moe_mxfp4._kernels, cuda_moe_mxfp4.launch_cuda

        def kernels_without(*a, **k):
            return {**kernels(*a, **k), f"mx_{piece}": _SKIPPED}

        def launch_unless_skipped(kernel, *a, **k):
            return None if kernel is _SKIPPED else launch(kernel, *a, **k)

        # per-pair gate/up launches mx_gate_up, the kernel skipped here, not the resident grid
        return [(cuda_moe_mxfp4, "_kernels", kernels_without), (cuda_moe_mxfp4, "launch_cuda", launch_unless_skipped),
                (cuda_moe_mxfp4, "RESIDENT_GATE_UP", None)]

    m, cfg, dev = runner.model, runner.cfg, runner.device
    hq, d = m.num_q_heads, cfg.head_dim
    if piece == "norms":
        return [(m, "_add_norm", lambda x, delta, weight, *a: (x, x))]
    if piece == "qkv":
        q = torch.randn(rows, hq, d, device=dev).to(torch.bfloat16)
        return [(m, "_rotated_q", lambda layer, t, *a: q[: t.shape[0]])]
    if piece == "attention":
        make = m.make_attention

        def make_attention(*a, **k):
            backends = make(*a, **k)
            for b in backends.values():
                b.run = lambda q, cache, sinks, out=None, early_launch=False: q
            return backends

        return [(m, "make_attention", make_attention)]
    if piece == "o":
        project, o_in = model_mod._project, hq * d
        y = torch.randn(rows, cfg.hidden_size, device=dev).to(torch.bfloat16)
        return [(model_mod, "_project",
                 lambda x, w, *a, **k: y[: x.shape[0]] if x.shape[-1] == o_in and w.shape[0] == cfg.hidden_size
                 else project(x, w, *a, **k))]
    if piece == "router":
        k = cfg.experts_per_token
        ids = (torch.arange(rows * k, device=dev) % cfg.num_local_experts).view(rows, k)
        wts = torch.full((rows, k), 1.0 / k, device=dev, dtype=torch.bfloat16)
        return [(m, "_route", lambda t, mlp: (wts[: t.shape[0]], ids[: t.shape[0]]))]
    if piece == "moe":
        return [(m, "_moe", lambda layer, t: t)]
    raise SystemExit(f"unknown piece {piece!r}; known: {ABLATIONS}")


def _fp8_attention(runner: ModelRunner) -> list[tuple[object, str, object]]:
    """Patches that give every layer FP8 QKV and O weights (the bf16 ones stay loaded beside them)."""
    from pdserve.kernels.fp8 import quantize_weight_fp8

    patches = []
    for a, _ in runner.model.w.layers:
        (qkv, qkv_scale), (o, o_scale) = quantize_weight_fp8(a.qkv_weight), quantize_weight_fp8(a.o_weight)
        patches += [(a, "qkv_weight", qkv), (a, "qkv_scale", qkv_scale), (a, "o_weight", o), (a, "o_scale", o_scale)]
    return patches


def _fp8_unembedding(runner: ModelRunner) -> list[tuple[object, str, object]]:
    """Patches that give the model an FP8 vocabulary projection (the bf16 one stays loaded beside it)."""
    from pdserve.kernels.fp8 import quantize_weight_fp8

    w, scale = quantize_weight_fp8(runner.model.w.unembedding)
    return [(runner.model.w, "unembedding", w), (runner.model.w, "unembedding_scale", scale)]


def _gemv(spec: str) -> dict:
    """'NxK:block_n,block_k,warps,stages[,programs per SM]' -> triton_bf16_gemv.CONFIGS with that
    shape for one token of an N x K projection (QKV + RoPE takes its shape from there too)."""
    shape, cfg = spec.split(":")
    n, k = (int(v) for v in shape.split("x"))
    bn, bk, nw, ns, *pps = (int(v) for v in cfg.split(","))
    gemv = triton_bf16_gemv.GemvConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                                       **({"programs_per_sm": pps[0]} if pps else {}))
    return {(triton_bf16_gemv, "CONFIGS"): {**triton_bf16_gemv.CONFIGS, (n, k, 1): gemv}}


def _kernel_shape(spec: str) -> tuple[int, ...]:
    """'warps,ksplit,batch[,min CTAs[,zero row]]' -> one kernel's launch shape (cuda_moe_mxfp4.MmaConfig)."""
    return tuple(int(v) for v in spec.split(","))


def _mma(spec: str) -> cuda_moe_mxfp4.MmaConfig:
    """'warps,ksplit,batch[,min CTAs[,zero row]]/...' (gate/up, then down) -> MmaConfig(gate_up, down)."""
    gu, dn = (_kernel_shape(part) for part in spec.split("/"))
    return cuda_moe_mxfp4.MmaConfig(gu, dn)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--precision", default="mxfp4", choices=["fp8", "mxfp4", "bf16"])
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS, the first the base")
    ap.add_argument("--mma-config", default=None,
                    help="also the default with this MXFP4 mma launch shape, gate/up and down as "
                         "'warps,ksplit,batch/warps,ksplit,batch' (kernels/cuda_moe_mxfp4.MmaConfig)")
    ap.add_argument("--pair-configs", default=None,
                    help="also the default with each of these launch shapes of the per-pair MXFP4 mma launches "
                         "(cuda_moe_mxfp4.PAIR_CONFIG), ';'-separated, each as --mma-config")
    ap.add_argument("--resident-gate-up", default=None,
                    help="also the default with the per-pair gate/up (up to RESIDENT_MAX_TOKENS tokens) as a resident "
                         "grid in each of these kernel shapes (cuda_moe_mxfp4.RESIDENT_GATE_UP), ';'-separated, each "
                         "'warps,ksplit,batch,CTAs an SM[,zero row]'; 'off': the launch of one CTA a tile")
    ap.add_argument("--resident-max-tokens", default=None,
                    help="also the default with the resident gate/up taking per-pair launches of up to each of "
                         "these many tokens (cuda_moe_mxfp4.RESIDENT_MAX_TOKENS), ';'-separated, each 'N' or "
                         "'N@warps,ksplit,batch,CTAs an SM,zero row' (in that shape)")
    ap.add_argument("--gemv-configs", default=None,
                    help="also the default with each of these one-token bf16 GEMV shapes, ';'-separated, each as "
                         "'NxK:block_n,block_k,warps,stages[,programs per SM]' (kernels/triton_bf16_gemv.GemvConfig)")
    ap.add_argument("--ablate", default=None,
                    help=f"also the default with each of these pieces taken out of every layer: comma-separated of "
                         f"{ABLATIONS}, or several joined by '+'")
    ap.add_argument("--ablate-on", default="default", help="the setting the ablations take out of (a name of SETTINGS)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--fp8", action="store_true",
                    help="every setting captures with FP8 attention and vocabulary projections")
    ap.add_argument("--timeline", action="store_true",
                    help="after the timing, each setting's step as a per-kernel timeline of a layer "
                         "(bench/step_timeline.py)")
    ap.add_argument("--trace", action="store_true",
                    help="with --fp8, at up to cuda_gemv_fp8.MAX_TOKENS tokens: each setting captured once more with "
                         "the timing build of the FP8 QKV and O launches (bench/projection_trace.py)")
    ap.add_argument("--trace-replays", type=int, default=5, help="replays a --trace capture is read after")
    ap.add_argument("--controls", type=int, default=0,
                    help="capture the first setting this many more times, as a measure of the run's noise")
    ap.add_argument("--layers", type=int, default=None,
                    help="load the checkpoint as a model of this many layers, layer i from its layer i mod n, each "
                         "in its own memory (bench/repeated_layers.py): a whole-depth step from a shallow checkpoint")
    ap.add_argument("--alias-layers", action="store_true",
                    help="with --layers: the repeated layers share the weights of the layers they repeat (the "
                         "same work over the checkpoint's address range only: a control for the footprint's cost)")
    ap.add_argument("--kv-blocks", type=int, default=8192, help="KV-cache blocks of the runner")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    names = [n.strip() for n in a.settings.split(",")]
    unknown = [n for n in [*names, a.ablate_on] if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    settings = {n: SETTINGS[n] for n in names}
    if a.mma_config:
        settings[f"mma {a.mma_config}"] = _setting({(cuda_moe_mxfp4, "CONFIG"): _mma(a.mma_config)})
    for cfg in (a.pair_configs.split(";") if a.pair_configs else []):
        settings[f"pair {cfg}"] = _setting({(cuda_moe_mxfp4, "PAIR_CONFIG"): _mma(cfg)})
    for spec in (a.resident_gate_up.split(";") if a.resident_gate_up else []):
        shape = None if spec.strip() == "off" else _kernel_shape(spec)
        settings[f"gate/up resident {spec}"] = _setting({(cuda_moe_mxfp4, "RESIDENT_GATE_UP"): shape})
    for spec in (a.resident_max_tokens.split(";") if a.resident_max_tokens else []):
        tokens, _, shape = spec.partition("@")
        patch = {(cuda_moe_mxfp4, "RESIDENT_MAX_TOKENS"): int(tokens)}
        if shape:
            patch[(cuda_moe_mxfp4, "RESIDENT_GATE_UP")] = _kernel_shape(shape)
        settings[f"gate/up resident to {spec} tokens"] = _setting(patch)
    for spec in (a.gemv_configs.split(";") if a.gemv_configs else []):
        settings[f"gemv {spec}"] = _setting(_gemv(spec))
    settings, controls = with_controls(settings, a.controls)
    with repeated_layers(a.layers):
        runner = ModelRunner(a.ckpt, device="cuda", precision=a.precision, num_kv_blocks=a.kv_blocks)
    if a.alias_layers:
        alias_repeated(runner.model.w, ModelConfig.load(a.ckpt).num_hidden_layers)
        torch.cuda.empty_cache()
    print(f"[launch_ab] {runner.cfg.num_hidden_layers} layers loaded"
          + (" (repeated ones aliased)" if a.alias_layers else ""), file=sys.stderr, flush=True)
    ablated = {}
    for piece in (p.strip() for p in a.ablate.split(",")) if a.ablate else []:
        name = f"skip {piece}" + ("" if a.ablate_on == "default" else f" ({a.ablate_on})")
        settings[name] = SETTINGS[a.ablate_on]
        ablated[name] = _ablation(runner, piece, max(a.batches))
    def capturing_with(group: tuple[str, ...]) -> set[str]:  # settings named in group, and ablations of one
        if a.fp8:
            return set(settings)
        return {n for n in settings
                if n in group or controls.get(n) in group or (n in ablated and a.ablate_on in group)}

    # settings that capture with FP8 projection weights
    fp8_named, fp8_vocab = capturing_with(FP8_ATTENTION), capturing_with(FP8_UNEMBEDDING)
    fp8 = _fp8_attention(runner) if fp8_named else []
    fp8_unembedding = _fp8_unembedding(runner) if fp8_vocab else []
    # per setting, the (object, attribute, value) set for its capture and undone after it
    patches = {name: [*((runner.model, k, v) for k, v in attrs.items()), *((mod, k, v) for (mod, k), v in consts.items()),
                      *ablated.get(name, []), *(fp8 if name in fp8_named else []),
                      *(fp8_unembedding if name in fp8_vocab else [])]
               for name, (_, attrs, consts) in settings.items()}
    g = torch.Generator().manual_seed(1)
    results, spreads, traces = {}, {}, {}
    for batch in a.batches:
        eng = LLMEngine(runner, max_batch_size=batch)
        params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(torch.randint(0, runner.cfg.vocab_size, (a.context,), generator=g).tolist(), params)
        while eng.waiting:
            eng.step()
        graphs, steps = {}, {}

        def capture(name: str, extra: tuple = ()):
            """The setting's graph of this batch (its patches and `extra` set while it is captured), after one
            real step through it (its inputs staged)."""
            # a setting whose kernels hang (or fault) stops here, named, not in the timing rounds after
            print(f"[launch_ab] batch {batch}: capturing and running {name!r}", file=sys.stderr, flush=True)
            os.environ.update(settings[name][0])
            changes = [*patches[name], *extra]
            saved = [(obj, k, vars(obj).get(k, _ABSENT)) for obj, k, _ in changes]
            for obj, k, v in changes:
                setattr(obj, k, v)
            graphs[name] = DecodeGraphs(runner.model, runner.cache, batch, max_context=runner.max_context)
            size = graphs[name].size_for(batch)
            graphs[name].capture_all([size])
            runner.decode_graphs = graphs[name]
            eng.step()
            torch.cuda.synchronize()
            for obj, k, v in reversed(saved):
                if v is _ABSENT:
                    delattr(obj, k)
                else:
                    setattr(obj, k, v)
            runner.decode_graphs = None
            return graphs[name]._steps[size]

        for name in settings:
            steps[name] = capture(name)
        times = {name: [] for name in settings}
        for _ in range(a.rounds):
            for name, step in steps.items():  # one timed run of `replays` back-to-back replays
                run = lambda: [step.graph.replay() for _ in range(a.replays)]  # noqa: E731
                times[name].append(time_it(run, reps=1, warmup=1, flush=False) * 1e6 / a.replays)
        base = statistics.median(times[next(iter(settings))])
        results[batch] = {}
        for name, ts in times.items():
            med = statistics.median(ts)
            results[batch][name] = {"replay_us": med, "min_us": min(ts), "ratio": med / base}
            print(f"batch {batch:3d} {a.precision:5s} {name:20s} replay {med:8.1f} us (min {min(ts):8.1f}) "
                  f"x{med / base:.3f}", flush=True)
        spread = control_spread({n: r["replay_us"] for n, r in results[batch].items()}, controls)
        if spread is not None:
            spreads[batch] = spread
            first = next(iter(settings))
            print(f"batch {batch:3d} captures of {first!r}: x{spread[0]:.3f}-x{spread[1]:.3f}", flush=True)
        for name, step in steps.items() if a.timeline else ():
            step_timeline.print_table(f"batch {batch} {name!r}",
                                      step_timeline.layer_table(step_timeline.kernel_events(step.graph.replay)))
        if a.trace and a.fp8 and batch <= cuda_gemv_fp8.MAX_TOKENS:
            kinds = ["windowed" if runner.cfg.is_sliding(i) else "full" for i in range(runner.cfg.num_hidden_layers)]
            for name in settings:
                trace = projection_trace.new_trace(4 * len(kinds), projection_trace.most_ctas(runner.cfg), runner.device)
                step = capture(name, ((cuda_gemv_fp8, "TRACE", trace),))
                trace.launches = trace.launches[-2 * len(kinds):]  # the step's graph is the last captured
                copies = []
                for _ in range(a.trace_replays):
                    step.graph.replay()
                    torch.cuda.synchronize()
                    copies.append(trace.buffer.cpu())
                rows = projection_trace.summarize(copies, trace, kinds)
                projection_trace.print_table(f"batch {batch} {name!r}", rows)
                traces.setdefault(batch, {})[name] = rows
        if ablated:  # the ablated steps left garbage in these requests' KV: drop them
            torch.cuda.synchronize()
            for seq in eng.running:
                runner.cache.release(seq.blocks)
        else:
            while eng.busy:
                eng.step()
        graphs.clear()  # the graphs and their memory go before the next batch
        steps.clear()
    if a.out:
        Path(a.out).write_text(json.dumps({"precision": a.precision, "context": a.context, "results": results,
                                           "control_spread": spreads, "projection_traces": traces,
                                           "command": "python " + " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
