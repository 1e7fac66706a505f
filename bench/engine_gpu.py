"""End to end on the GPU: a gpt-oss-20b-shaped model (random weights, all layers) through the
engine with the CUDA kernels (FlashInfer sink attention, Triton FP8 MoE), checked against the
plain-torch path on the same weights, then timed: prefill of 8k tokens, decode tokens/s at batch
1 and 64, as ratios to the step's memory floor (bytes it must read / copy bandwidth measured in the
same run).

    python bench/engine_gpu.py --preset 20b --out OUT [--record docs/performance.md]
        [--compare-fused]   decode also with the fused per-layer kernels off (same run, same weights)
        [--profile]         prefill: ms per category (MoE, attention, dense GEMMs, norms/RoPE,
                            router) against FLOPs / the FP8 rate measured in the run; decode:
                            per-category GPU time of the replayed step, kernels, host time
        [--prompt-len 32768 --prefill-chunk-tokens 8192 --prefill-only]   a long prompt, chunked
        [--peer-triton]     then OpenAI's Triton implementation (gpt_oss.triton) on the same weights:
                            its decode step per batch size, and pdserve's throughput over its
                            (bench/peer_triton.py; needs gpt-oss and triton_kernels)
        [--attention-precision fp8]   QKV / O projection weights in FP8 (decode batches up to 4 tokens:
                            kernels/cuda_gemv_fp8.py; else kernels/triton_fp8_linear.py)
        [--compare-attention-precision]   prefill and decode with bf16, then FP8 projections (same
                            run, same weights: the FP8 ones quantised from the loaded bf16 ones)
        [--unembedding-precision fp8]   the vocabulary projection's weights in FP8 (decode batches up to
                            8 tokens: kernels/cuda_gemv_fp8.py's streaming entry)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import copy_bandwidth  # noqa: E402
from pdserve.engine.checkpoint_writer import make_random_checkpoint  # noqa: E402
from pdserve.engine.config import DEFAULT_PREFILL_CHUNK, preset  # noqa: E402
from pdserve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.sampling import SamplingParams  # noqa: E402
from pdserve.engine.sequence import Sequence  # noqa: E402
from pdserve.launch.cli import add_projection_precision_args, projection_precisions  # noqa: E402
from pdserve.kernels.mxfp4 import MxExperts  # noqa: E402


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@contextlib.contextmanager
def torch_path(runner: ModelRunner, attention: bool = True, moe: bool = True):
    """Run the same runner through the plain-torch references (attention and/or MoE)."""
    import pdserve.engine.model as model_mod
    from pdserve.kernels.experts import experts_forward_mxfp4_ref, experts_forward_ref
    from pdserve.kernels.mxfp4 import MxExperts

    def reference(x, weights, ids, w, *a, x_before_routing=False, l2_prefetch=None, **kw):  # launch / cache hints only
        return (experts_forward_mxfp4_ref if isinstance(w, MxExperts) else experts_forward_ref)(x, weights, ids, w, *a, **kw)

    saved_moe, saved_attn, saved_backend = model_mod.experts_forward, runner.attention, runner.model.attention_backend
    saved_proj = model_mod.linear_fp8
    if moe:
        model_mod.experts_forward = reference
    if attention:
        from pdserve.kernels.fp8 import fp8_weight_linear_ref

        runner.model.attention_backend = "torch"
        runner.attention = runner.model.make_attention()
        model_mod.linear_fp8 = lambda x, w, s, b=None: fp8_weight_linear_ref(x, w, s, b).to(x.dtype)
    try:
        yield
    finally:
        model_mod.experts_forward = saved_moe
        model_mod.linear_fp8 = saved_proj
        runner.model.attention_backend = saved_backend
        runner.attention = saved_attn


class AttentionPrecisions:
    """Both forms of the attention projections on one runner: the loaded bf16 weights and their
    FP8 128x128 quantisation (as loading with attention_precision fp8 makes), swapped in place."""

    def __init__(self, runner: ModelRunner):
        from pdserve.kernels.fp8 import quantize_weight_fp8

        self.layers = [a for a, _ in runner.model.w.layers]
        if any(a.qkv_scale is not None for a in self.layers):
            raise ValueError("--compare-attention-precision starts from bf16 projections")
        self.forms = {
            "bf16": [(a.qkv_weight, None, a.o_weight, None) for a in self.layers],
            "fp8": [(*quantize_weight_fp8(a.qkv_weight), *quantize_weight_fp8(a.o_weight)) for a in self.layers],
        }

    def use(self, precision: str) -> None:
        for a, (qkv, qkv_scale, o, o_scale) in zip(self.layers, self.forms[precision]):
            a.qkv_weight, a.qkv_scale, a.o_weight, a.o_scale = qkv, qkv_scale, o, o_scale


def compare_per_call(runner: ModelRunner, ids: list[int]) -> dict[str, list[float]]:
    """Run a prefill where every attention and MoE call also runs its torch reference on the
    very same inputs: kernel error without the compounding of a chaotic random model."""
    import pdserve.engine.model as model_mod
    from pdserve.kernels.attention import TorchSinkAttention
    from pdserve.kernels.experts import experts_forward_ref

    errs: dict[str, list[float]] = {"attention": [], "moe": []}
    fast_moe = model_mod.experts_forward

    def moe(x, w, i, ew, *args, **kw):
        y = fast_moe(x, w, i, ew, *args, **kw)
        kw.pop("x_before_routing", None)  # launch-order and cache hints of the kernels, not the reference's
        kw.pop("l2_prefetch", None)
        errs["moe"].append(rel_l2(y.float(), experts_forward_ref(x, w, i, ew, *args, **kw).float()))
        return y

    saved = {g: (att.plan, att.run) for g, att in runner.attention.items()}
    for g, att in runner.attention.items():
        ref = TorchSinkAttention(att.window_left, att.sm_scale)

        def plan(batch, _p=att.plan, _r=ref):
            _p(batch)
            _r.plan(batch)

        def run(q, kv, sinks, out=None, early_launch=False, _f=att.run, _r=ref):
            y = _f(q, kv, sinks, early_launch=early_launch)
            errs["attention"].append(rel_l2(y.float(), _r.run(q, kv, sinks).float()))
            return y

        att.plan, att.run = plan, run
    model_mod.experts_forward = moe
    try:
        runner.prompt_logits(ids)
    finally:
        model_mod.experts_forward = fast_moe
        for g, att in runner.attention.items():
            att.plan, att.run = saved[g]
    return errs


def decode_bytes(runner: ModelRunner, batch: int, context: int, expert_bits: float | None = None) -> float:
    """Bytes one decode step must read at least: every non-expert weight once (the embedding's B
    rows), the experts the batch routes to (expected distinct ones under uniform routing), the KV
    of every request (sliding layers: the window). expert_bits: weight bits per expert parameter
    instead of the loaded format (4.25 = MXFP4: 4-bit values + one 8-bit scale per 32)."""
    cfg, w = runner.cfg, runner.model.w
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = nbytes(w.unembedding) + nbytes(w.norm) + batch * w.embedding.shape[1] * w.embedding.element_size()
    e, k = cfg.num_local_experts, cfg.experts_per_token
    touched = e * (1 - (1 - k / e) ** batch)
    for i, (a, m) in enumerate(w.layers):
        total += sum(nbytes(t) for t in (a.qkv_weight, a.qkv_bias, a.o_weight, a.o_bias, a.sinks, a.norm,
                                         a.qkv_scale, a.o_scale, m.router_weight, m.router_bias, m.norm)
                     if t is not None)
        ex = m.experts
        if isinstance(ex, MxExperts):  # as published: blocks, scales and biases
            per = sum(nbytes(t) for t in (ex.gate_up_blocks, ex.gate_up_scales, ex.gate_up_bias,
                                          ex.down_blocks, ex.down_scales, ex.down_bias)) / ex.num_experts
        else:
            if expert_bits is None:
                per = sum(nbytes(t) for t in (ex.gate_up, ex.down, ex.gate_up_scale, ex.down_scale)
                          if t is not None) / ex.num_local_experts
            else:
                per = (ex.gate_up[0].numel() + ex.down[0].numel()) * expert_bits / 8
            per += (nbytes(ex.gate_up_bias) + nbytes(ex.down_bias)) / ex.num_local_experts
        total += touched * per
        keys = min(context, cfg.sliding_window) if cfg.is_sliding(i) and cfg.sliding_window > 0 else context
        total += batch * keys * 2 * runner.model.num_kv_heads * cfg.head_dim * 2
    return total


def _eager(runner: ModelRunner, plan) -> torch.Tensor:
    saved, runner.decode_graphs = runner.decode_graphs, None
    try:
        return runner.execute(plan)
    finally:
        runner.decode_graphs = saved


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, sync=_sync):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def steady_step_s(eng, steps: int) -> tuple[float, float]:
    """(seconds a decode step in the engine's steady state, seconds of it the host spent waiting
    for the GPU). `timed` starts its window from an idle GPU (it synchronises first), so the
    window's first step plans on the host with nothing in flight. Here two steps refill the
    pipeline first, and the window runs from the return of one step call to the return of the
    `steps`-th call after it, without a sync at either end: the engine keeps at most one step in
    flight and each call waits for the ids of the step before, so both ends sit at the same phase
    of the pipeline and the window holds exactly `steps` steps, each planned while the one before
    it ran, as in a long generation. The wait is the time spent in CUDA event synchronisations (the
    in-flight step's ids, and the graph's staging buffer before it is refilled): near zero, the host
    and not the GPU sets the step's pace."""
    for _ in range(2):
        eng.step()
    waited = [0.0]
    event = torch.cuda.Event
    synchronize = event.synchronize

    def timed_synchronize(self):
        t0 = time.perf_counter()
        synchronize(self)
        waited[0] += time.perf_counter() - t0

    event.synchronize = timed_synchronize
    try:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        elapsed = time.perf_counter() - t
    finally:
        event.synchronize = synchronize
    return elapsed / steps, waited[0] / steps


def _logits_rc(err: float, bound: float | None) -> int:
    if bound is not None and not err <= bound:
        print(f"logits rel L2 {err:.2e} above --max-logits-rel-l2 {bound:.1e}", flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="20b")
    ap.add_argument("--ckpt", default="/tmp/pdserve-bench-ckpt")
    ap.add_argument("--out", default=".")
    ap.add_argument("--check-tokens", type=int, default=512)
    ap.add_argument("--prefill-tokens", "--prompt-len", dest="prefill_tokens", type=int, default=8192,
                    help="prompt length of the timed prefill")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=DEFAULT_PREFILL_CHUNK,
                    help="longer prompts run in chunks of this many tokens (engine.model_runner)")
    ap.add_argument("--prefill-only", action="store_true", help="stop after the prefill (no decode)")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 64])
    ap.add_argument("--record", default=None, help="markdown file whose engine-gpu section is replaced")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--diagnose", action="store_true", help="swap attention / MoE paths separately and stop")
    ap.add_argument("--compare-fused", action="store_true",
                    help="decode with the fused per-layer kernels off, then on (same run)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the prefill and each decode batch (bench/step_profile.py)")
    ap.add_argument("--max-logits-rel-l2", type=float, default=None,
                    help="exit 1 when the logits differ more from the plain-torch path (with real "
                         "weights; on random weights the two diverge by design: docs/performance.md)")
    ap.add_argument("--compare-moe-prefill", action="store_true",
                    help="time the prefill with the Triton MoE kernels, then with DeepGEMM's (same run)")
    ap.add_argument("--precision", default="fp8", choices=["fp8", "bf16", "mxfp4"],
                    help="expert format in memory (mxfp4: as published, MXFP4 decode kernel)")
    add_projection_precision_args(ap)
    ap.add_argument("--compare-attention-precision", action="store_true",
                    help="prefill and decode with bf16, then FP8 attention projections (same run)")
    ap.add_argument("--mxfp4-decode", default=None, choices=["bits", "dot", "packed"],
                    help="with --precision mxfp4: the MXFP4 kernel's nibble decode (default: the kernel's)")
    ap.add_argument("--mxfp4-config", default=None,
                    help="with --mxfp4-decode: the kernel's launch shape, 'gate_up/down' as BLOCK_N,G_STEP,WARPS,STAGES "
                         "each, e.g. 64,8,4,3/16,8,2,3")
    ap.add_argument("--mxfp4-grouped-from", type=int, default=None,
                    help="with --precision mxfp4: batches of at least this many tokens take the expert-grouped "
                         "tensor-core kernels (kernels.moe.MXFP4_GROUPED_MIN_TOKENS)")
    ap.add_argument("--mxfp4-grouped-config", default=None,
                    help="their launch shape: BLOCK_M/BN,BK,warps,stages/BN,BK,warps,stages (gate_up/down)")
    ap.add_argument("--mxfp4-mma-max-tokens", type=int, default=None,
                    help="with --precision mxfp4: batches up to this many tokens take the CUDA mma kernels "
                         "(kernels.moe.MXFP4_MMA_MAX_TOKENS; 0: never)")
    ap.add_argument("--peer-triton", action="store_true",
                    help="after pdserve's decode, time OpenAI's gpt_oss.triton on the same weights")
    a = ap.parse_args(argv)
    if a.peer_triton:
        from pdserve.bench import peer_triton

        if a.device != "cuda" or a.prefill_only or a.diagnose:
            ap.error("--peer-triton times decode on CUDA: needs --device cuda, without --prefill-only/--diagnose")
        if (why := peer_triton.missing()) is not None:
            ap.exit(2, f"engine_gpu.py: --peer-triton {why}\n")
    if a.mxfp4_decode:
        import pdserve.kernels.moe as moe_mod
        from pdserve.kernels.triton_moe_mxfp4 import MxConfig

        moe_mod.MXFP4_KERNEL_CONFIG = {"bits": MxConfig(decode="bits"), "packed": None,
                                       "dot": MxConfig((64, 256, 4, 3), (32, 256, 4, 3), decode="dot")}[a.mxfp4_decode]
        moe_mod.MXFP4_CUDA_LAYOUT = "packed" if a.mxfp4_decode == "packed" else "published"
        if a.mxfp4_config:
            gu, dn = (tuple(int(v) for v in part.split(",")) for part in a.mxfp4_config.split("/"))
            moe_mod.MXFP4_KERNEL_CONFIG = MxConfig(gu, dn, decode=a.mxfp4_decode)
    if a.mxfp4_mma_max_tokens is not None:
        import pdserve.kernels.moe as moe_mod

        moe_mod.MXFP4_MMA_MAX_TOKENS = a.mxfp4_mma_max_tokens or None
    if a.mxfp4_grouped_from is not None:
        import pdserve.kernels.moe as moe_mod

        moe_mod.MXFP4_GROUPED_MIN_TOKENS = a.mxfp4_grouped_from
    if a.mxfp4_grouped_config:
        import pdserve.kernels.moe as moe_mod
        from pdserve.kernels.triton_moe_mxfp4_grouped import GroupedConfig

        bm, gu, dn = a.mxfp4_grouped_config.split("/")
        moe_mod.MXFP4_GROUPED_CONFIG = GroupedConfig(int(bm), *(tuple(int(v) for v in p.split(",")) for p in (gu, dn)))
    if a.compare_fused and a.device != "cuda":
        ap.error("--compare-fused needs --device cuda")
    if a.compare_attention_precision and a.attention_precision != "bf16":
        ap.error("--compare-attention-precision loads bf16 projections and quantises them itself")
    if a.compare_attention_precision and a.compare_moe_prefill:
        ap.error("--compare-attention-precision and --compare-moe-prefill: one comparison per run")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = preset(a.preset)
    if a.layers:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers, layer_types=())
    ckpt = Path(a.ckpt) / f"{a.preset}-{cfg.num_hidden_layers}"
    if not (ckpt / "config.json").is_file():
        _, t = timed(lambda: make_random_checkpoint(ckpt, cfg, seed=0, workers=min(16, os.cpu_count() or 1)), sync=lambda: None)
        print(f"wrote {a.preset} checkpoint in {t:.0f} s", flush=True)
    runner, t_load = timed(lambda: ModelRunner(str(ckpt), device=a.device, precision=a.precision, num_kv_blocks=8192,
                                                **projection_precisions(a)))
    runner.prefill_chunk_tokens = a.prefill_chunk_tokens
    print(f"loaded in {t_load:.0f} s; attention backend {type(runner.attention['full']).__name__}", flush=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.check_tokens,), generator=g).tolist()
    fast = runner.prompt_logits(ids)
    with torch_path(runner):
        ref = runner.prompt_logits(ids)
    err = rel_l2(fast, ref)
    agree = float((fast.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"logits vs torch path: rel L2 {err:.2e}, argmax agreement {agree:.3f}", flush=True)
    attn_forms = AttentionPrecisions(runner) if a.compare_attention_precision else None
    attn_list = ["bf16", "fp8"] if attn_forms else [a.attention_precision]
    if attn_forms:
        attn_forms.use("fp8")
        fast8 = runner.prompt_logits(ids)
        with torch_path(runner):
            ref8 = runner.prompt_logits(ids)
        attn_forms.use("bf16")
        print(f"FP8 attention projections: logits vs torch path rel L2 {rel_l2(fast8, ref8):.2e}; vs bf16 "
              f"projections rel L2 {rel_l2(fast8, fast):.2e}, argmax agreement "
              f"{float((fast8.argmax(-1) == fast.argmax(-1)).float().mean()):.3f}", flush=True)
    if a.diagnose:
        per_call = compare_per_call(runner, ids)
        for kind, errs in per_call.items():
            print(f"per-call {kind} vs reference on identical inputs: max rel L2 {max(errs):.2e}, "
                  f"median {sorted(errs)[len(errs) // 2]:.2e} over {len(errs)} calls", flush=True)
        for n in (100, a.check_tokens):
            sub = ids[:n]
            with torch_path(runner):
                r = runner.prompt_logits(sub)
            with torch_path(runner, attention=False, moe=True):
                fa = runner.prompt_logits(sub)
            with torch_path(runner, attention=True, moe=False):
                fm = runner.prompt_logits(sub)
            both = runner.prompt_logits(sub)
            print(f"{n} tokens: fast attention only {rel_l2(fa, r):.2e}; fast MoE only {rel_l2(fm, r):.2e}; "
                  f"both {rel_l2(both, r):.2e}", flush=True)
        for backend in ("fa2", "fa3"):
            for att in runner.attention.values():
                att.prefill_backend = backend
            print(f"prefill backend {backend}: {rel_l2(runner.prompt_logits(ids[:100]), ref[:100]):.2e}", flush=True)
        return 0

    # prefill at batch size 1; with --compare-moe-prefill once per MoE prefill path (same run)
    import pdserve.kernels.moe as moe_mod
    from pdserve.kernels import deepgemm_moe

    long_ids = torch.randint(0, cfg.vocab_size, (a.prefill_tokens,), generator=g).tolist()
    dg_default = moe_mod.DEEPGEMM_MIN_ROWS_PER_EXPERT
    moe_paths = {"default": dg_default}
    if attn_forms:
        moe_paths = {"attention bf16": dg_default, "attention fp8": dg_default}
    if a.compare_moe_prefill:
        if not deepgemm_moe.available():
            ap.error("--compare-moe-prefill needs DeepGEMM installed on a Hopper GPU (README, 'Real weights')")
        moe_paths = {"triton": None, "deepgemm": dg_default}
    prefill, prefill_profile = {}, None
    for path, min_rows in moe_paths.items():
        moe_mod.DEEPGEMM_MIN_ROWS_PER_EXPERT = min_rows
        if attn_forms:
            attn_forms.use(path.split()[-1])
        runner.prompt_logits(long_ids[:1024])  # warm-up (JIT, plans)
        times = []
        for _ in range(3):
            seq = Sequence("p", long_ids, SamplingParams(max_new_tokens=1, temperature=0))
            seq.blocks = runner.cache.reserve(len(long_ids), local_prompt_tokens=len(long_ids))
            _, t = timed(lambda: runner.prefill(seq))
            runner.cache.release(seq.blocks)
            times.append(t)
        t_path = sorted(times)[1]
        chunks = -(-a.prefill_tokens // a.prefill_chunk_tokens)
        print(f"prefill {a.prefill_tokens} tokens ({chunks} chunk{'s' if chunks > 1 else ''} of <= "
              f"{a.prefill_chunk_tokens}), {path if attn_forms else 'MoE path ' + path}: {t_path * 1e3:.1f} ms "
              f"({a.prefill_tokens / t_path:.0f} tok/s)", flush=True)
        prefill[path] = {"ms": t_path * 1e3, "tok_s": a.prefill_tokens / t_path}
        if a.profile:
            from pdserve.bench.step_profile import fp8_flops_rate, prefill_table, profile_prefill

            prof = profile_prefill(runner, long_ids, fp8_flops_rate())
            prefill[path]["profile"] = prof
            prefill_profile = prof  # the last path's (the default one) goes to the doc
            print("\n".join(prefill_table(prof)), flush=True)
    moe_mod.DEEPGEMM_MIN_ROWS_PER_EXPERT = dg_default
    t_prefill = prefill[list(moe_paths)[-1]]["ms"] / 1e3
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    result = {"date": datetime.date.today().isoformat(), "device": device_name,
              "preset": a.preset, "logits_rel_l2": err, "argmax_agreement": agree, "load_s": t_load,
              "prefill_tokens": a.prefill_tokens, "prefill_chunk_tokens": a.prefill_chunk_tokens,
              "prefill_ms": t_prefill * 1e3, "prefill_tok_s": a.prefill_tokens / t_prefill,
              "prefill_by_moe_path": {k: {"ms": v["ms"], "tok_s": v["tok_s"]} for k, v in prefill.items()},
              "prefill_profile": prefill_profile, "command": "python " + " ".join(sys.argv)}
    if a.prefill_only:
        (out / "engine_gpu.json").write_text(json.dumps(result, indent=2))
        return _logits_rc(err, a.max_logits_rel_l2)

    # decode: batch of B requests at a given context; time steps after the prefills, eagerly and
    # replayed from CUDA graphs (engine.cuda_graphs), the same requests' next steps; with
    # --compare-fused once per variant of the per-layer kernels (the model reads the flag per call)
    bw = copy_bandwidth() if a.device == "cuda" else float("nan")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    decode, graph_err, profiles = {}, {}, {}
    fused_default = runner.model.fused
    # (per-layer kernels, pipelined decode): before = the torch ops stepped one at a time
    variants = ([("plain", False), ("fused", False), ("fused", True)] if a.compare_fused
                else [("fused" if fused_default else "plain", True)])
    variants = [(k, p, attn) for attn in attn_list for k, p in variants]
    for kernels, pipeline, attn in variants:
        variant = f"{kernels}{', pipelined' if pipeline else ''}{', attention ' + attn if attn_forms else ''}"
        if attn_forms:
            attn_forms.use(attn)
        runner.model.fused = kernels == "fused"
        graphs = DecodeGraphs(runner.model, runner.cache, max(a.batches), max_context=runner.max_context,
                              capture=a.device == "cuda")
        for batch in a.batches:
            eng = LLMEngine(runner, max_batch_size=batch, pipeline=pipeline)
            prompts = [torch.randint(0, cfg.vocab_size, (a.decode_context,), generator=g).tolist() for _ in range(batch)]
            params = SamplingParams(temperature=0, max_new_tokens=4 * a.decode_steps + 96, ignore_eos=True)
            for p in prompts:
                eng.add_request(p, params)
            while eng.waiting:
                eng.step()  # prefills, then the first decode steps
            floor_s = decode_bytes(runner, batch, a.decode_context) / bw
            floor4_s = decode_bytes(runner, batch, a.decode_context, expert_bits=4.25) / bw
            for mode in ("graphs",) if pipeline and a.compare_fused else ("eager", "graphs"):
                runner.decode_graphs = graphs if mode == "graphs" else None
                if mode == "graphs":
                    graphs.capture_all([graphs.size_for(batch)])
                    plan = runner.decode_plan(eng.running)  # one step both ways, same inputs
                    graph_err[f"{variant} {batch}"] = rel_l2(
                        graphs.run(plan.input_ids, plan.positions, plan.slots, plan.batches), _eager(runner, plan))
                for _ in range(3):
                    eng.step()
                _, t = timed(lambda: [eng.step() for _ in range(a.decode_steps)])
                per_step = t / a.decode_steps
                steady, waited = steady_step_s(eng, a.decode_steps)
                decode[f"{variant} {mode} {batch}"] = {
                    "batch": batch, "mode": mode, "kernels": variant, "step_ms": per_step * 1e3,
                    "steady_step_ms": steady * 1e3, "steady_host_wait_ms": waited * 1e3,
                    "tok_s_total": batch / per_step, "tok_s_per_req": 1 / per_step,
                    "floor_ms": floor_s * 1e3, "floor_mxfp4_ms": floor4_s * 1e3}
                print(f"decode ({variant}, {mode}) batch {batch} @ {a.decode_context}: {per_step * 1e3:.2f} "
                      f"ms/step, {batch / per_step:.0f} tok/s total; floor {floor_s * 1e3:.3f} ms "
                      f"({floor_s / per_step:.0%}), MXFP4-expert floor {floor4_s * 1e3:.3f} ms; steady state "
                      f"{steady * 1e3:.3f} ms/step, of which the host waited {waited * 1e3:.3f} ms for the GPU", flush=True)
            if a.profile and a.device == "cuda" and (kernels, pipeline, attn) in (variants[0], variants[-1]):
                from pdserve.bench.step_profile import profile_decode

                prof = profile_decode(eng, runner, graphs)
                profiles[f"{variant}, batch {batch}"] = prof
                print(f"profile ({variant}) batch {batch}: replay {prof['replay_us']:.0f} us, "
                      f"{prof['kernels_per_step']:.0f} kernels, host before replay "
                      f"{prof['host_before_replay_us']:.0f} us", flush=True)
                for c, v in prof["categories"].items():
                    print(f"    {c:40s} {v['us']:8.1f} us {v['critical_us']:8.1f} us on the critical path "
                          f"{v['kernels']:6.1f} kernels", flush=True)
                pl = prof["pipeline"]
                print(f"    pipelined steady state: {prof['pipelined_step_us']:.0f} us a step (wall); GPU busy "
                      f"{pl['busy_us']:.0f} us, idle {pl['idle_us']:.0f} us; outside the graph "
                      f"{pl['outside_graph_us']:.1f} us in {pl['outside_graph_ops']:.1f} ops a step", flush=True)
                for n, v in list(pl["outside_graph"].items())[:8]:
                    print(f"        {v['us']:6.1f} us {v['ops']:4.1f}x {n[:100]}", flush=True)
                for gp in pl["gaps"]:
                    print(f"        gap {gp['us']:6.1f} us after {gp['after'][:60]} before {gp['before'][:60]}", flush=True)
            runner.decode_graphs = None
            while eng.busy:
                eng.step()
        del graphs
    runner.model.fused = fused_default
    for b, e in graph_err.items():
        print(f"decode step batch {b}: graph vs eager logits rel L2 {e:.2e}", flush=True)
    if profiles:
        from pdserve.bench.step_profile import table

        print("\n".join(table(profiles)), flush=True)

    peer = None
    if a.peer_triton:
        # pdserve's engine step per batch in the shipped variant (the last one measured), graphs
        ours = {b: decode[f"{variant} graphs {b}"]["step_ms"] for b in a.batches}
        peer = peer_triton.measure(ckpt, cfg, a.batches, a.decode_context, a.decode_steps, ids, fast, ours, g)
        print(f"peer {peer['impl']}: loaded in {peer['load_s']:.0f} s; logits vs pdserve ({a.check_tokens} tokens) "
              f"rel L2 {peer['logits_rel_l2_vs_pdserve']:.2e}, argmax agreement "
              f"{peer['argmax_agreement_vs_pdserve']:.3f}; pdserve = {variant}, graphs", flush=True)
        print("\n".join(peer_triton.table(peer)), flush=True)

    result.update(decode=decode, graph_vs_eager_rel_l2=graph_err, copy_bandwidth=bw, profiles=profiles,
                  peer_triton=peer)
    (out / "engine_gpu.json").write_text(json.dumps(result, indent=2))
    if a.record:
        lines = [
            "", "<!-- engine-gpu:begin -->", "## Engine end to end (GPU)", "",
            f"Measured {result['date']} on {result['device']}, command: `{result['command']}`. "
            f"Random {a.preset}-shaped weights (all {cfg.num_hidden_layers} layers), {a.precision} experts, "
            f"{'bf16 and FP8' if attn_forms else a.attention_precision} attention projections, "
            f"{a.unembedding_precision} vocabulary projection; decode "
            "eager and replayed from CUDA graphs (engine.cuda_graphs) on the same requests; kernels: "
            "plain = the torch per-layer ops, fused = kernels/triton_norm, _rope, _router; pipelined = "
            "each step launched before the host reads the previous step's tokens (engine.llm_engine). Floors: bytes a "
            f"step must read / the copy bandwidth measured in the same run ({bw / 1e12:.2f} TB/s), with the "
            "experts as loaded (FP8) and as published (MXFP4).", "",
            "| what | value | floor (FP8 experts) | floor / time | floor (MXFP4 experts) | floor / time |",
            "|---|---|---|---|---|---|",
            f"| logits vs plain-torch path ({a.check_tokens} tokens) | rel L2 {err:.2e}, argmax agreement {agree:.3f} | | | | |",
        ] + [f"| prefill {a.prefill_tokens} tokens, batch 1 (chunks of {a.prefill_chunk_tokens}), MoE path "
             f"{path} | {v['ms']:.1f} ms, {v['tok_s']:.0f} tok/s | | | | |" for path, v in prefill.items()] + [f"| decode ({d['kernels']}, {d['mode']}) batch {d['batch']} at context {a.decode_context} | "
             f"{d['step_ms']:.2f} ms/step, {d['tok_s_total']:.0f} tok/s total | {d['floor_ms']:.3f} ms | "
             f"{d['floor_ms'] / d['step_ms']:.0%} | {d['floor_mxfp4_ms']:.3f} ms | {d['floor_mxfp4_ms'] / d['step_ms']:.0%} |"
             for d in decode.values()] + [
            f"| decode step, graph vs eager logits, {b} | rel L2 {e:.2e} | | | | |" for b, e in graph_err.items()
        ]
        if prefill_profile:
            from pdserve.bench.step_profile import prefill_table

            lines += ["", "Prefill profile (`--profile`): time per category over every chunk of the prompt "
                      "(GPU kernel time, from a profiled run after the timed ones), floor = useful FLOPs / "
                      f"FP8 `torch._scaled_mm` 8192^3 rate measured in the run "
                      f"({prefill_profile['fp8_tflops'] or 0:.0f} TFLOP/s).", ""] + prefill_table(prefill_profile)
        if profiles:
            from pdserve.bench.step_profile import table

            lines += ["", "Decode step profile (`--profile`): GPU time per category of the replayed CUDA graph "
                      "(us per step, kernels per step; categories from an eager step of the same batch "
                      "labelled per model part), the replay alone back to back, and the host's median time "
                      "per engine step in each phase (GPU idle while the host plans).", ""] + table(profiles)
        if peer:
            lines += ["", f"Same-run peer (`--peer-triton`): OpenAI's Triton implementation, {peer['impl']}, "
                      "loaded by its own `from_checkpoint` from the same files (MXFP4 experts through "
                      "`triton_kernels.matmul_ogs`); its logits on the check prompt against pdserve's: rel L2 "
                      f"{peer['logits_rel_l2_vs_pdserve']:.2e}, argmax agreement {peer['argmax_agreement_vs_pdserve']:.3f}. "
                      "Its decode step as its `TokenGenerator` runs it (one CUDA graph replayed per token, greedy "
                      "ids read back by the host), over a cache of B equal-length rows sized to the context plus "
                      f"the steps taken (its decode attention reads the whole cache); pdserve: decode ({variant}, "
                      "graphs) above. pdserve / peer = pdserve's tokens/s over the peer's (> 1: pdserve faster).",
                      ""] + peer_triton.table(peer)
        lines += ["<!-- engine-gpu:end -->", ""]
        from pdserve.bench.doc_section import replace_section

        body = "\n".join(lines).strip("\n")  # from the begin marker to the end marker
        replace_section(Path(a.record), "<!-- engine-gpu:begin -->", "<!-- engine-gpu:end -->", body)
    return _logits_rc(err, a.max_logits_rel_l2)


if __name__ == "__main__":
    sys.exit(main())
