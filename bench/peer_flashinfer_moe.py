"""Same-run peer for the MXFP4 decode MoE named by the decode-floor issue: FlashInfer's `cutlass_fused_moe`
on Hopper (MXFP4 weights x bf16 activations through CUTLASS' SM90 mixed-input grouped GEMM,
`use_w4_group_scaling=True`, with expert biases and gpt-oss' clamped SwiGLU), on the same experts, routing
sets and timing as bench/moe_mxfp4.py and bench/peer_marlin.py, against the path pdserve's engine takes
(`kernels.moe.experts_forward`).

    python -m pdserve.bench.peer_flashinfer_moe [--experts 128] [--tokens 1,4,16,64] [--no-autotune]

FlashInfer compiles the module (`fused_moe_90`) at first use, which takes hours on a few cores: build it
ahead on any x86-64 host, no GPU needed (`bash bench/build_flashinfer_moe90.sh FLASHINFER_WHEEL OUT_DIR`:
the 38 objects of the MXFP4 x bf16 path, about 50 minutes on two cores), put `fused_moe_90.so` where
FlashInfer looks for prebuilt modules (`flashinfer/data/aot/fused_moe_90/`) and set
FLASHINFER_DISABLE_JIT=1 so that a failed load says so instead of starting the build.

The weights are handed over as FlashInfer takes them: gate/up as [linear rows; glu rows] (the published
layout interleaves them: glu even, linear odd), bytes and E8M0 scales interleaved for the SM90 GEMM by
FlashInfer's own helpers, whose scale interleave takes K in whole 128-wide blocks: gpt-oss' 2880 (hidden
and intermediate) runs as 2944, padded with zero weights and biases, so the layer's output is the first
2880 columns. The tactic of each batch is picked by FlashInfer's autotuner first (its default is slower
at small batches). rel L2 is each output against `experts_forward_mxfp4_ref` (the experts decoded
exactly), so a wrong layout shows; of floor = the routed experts' unpadded MXFP4 bytes / copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pdserve.bench.kernels import copy_bandwidth
from pdserve.bench.moe_mxfp4 import expert_bytes, layer_batch, random_layer, save_rows, time_runs
from pdserve.kernels.experts import experts_forward_mxfp4_ref
from pdserve.kernels.moe import experts_forward
from pdserve.kernels.mxfp4 import MxExperts

GROUP = 32  # MXFP4: one E8M0 scale a group of 32 weights
BLOCK = 128  # K block of the SM90 scale interleave: K / GROUP a multiple of 4


def pad_to(t: torch.Tensor, dim: int, size: int, value: int = 0) -> torch.Tensor:
    """t with dim `dim` padded at its end to `size` with `value` (FlashInfer's SM90 scale interleave takes K
    in whole blocks of BLOCK: gpt-oss' 2880 is 22.5 of them)."""
    extra = size - t.shape[dim]
    if extra == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim)


def halves_padded(t: torch.Tensor, rows: int, value: int = 0) -> torch.Tensor:
    """Gate/up rows (dim 1) from the published interleave (glu even, linear odd) to FlashInfer's [linear; glu]
    halves, each half padded with `value` to `rows`."""
    return torch.cat([pad_to(t[:, 1::2], 1, rows, value), pad_to(t[:, 0::2], 1, rows, value)], dim=1).contiguous()


class FlashInferExperts:
    """`w` (published layout) as FlashInfer's SM90 mixed-input MoE takes it: the hidden and intermediate sizes
    padded to whole K blocks (BLOCK) with zero weights (codes 0, scale 2^0) and zero biases, so the padded
    activations are SwiGLU(0, 0) = 0 and the padded output columns 0."""

    def __init__(self, w: MxExperts, fused_moe):
        e, n2, kg, _ = w.gate_up_blocks.shape
        hidden, inter = kg * GROUP, n2 // 2
        self.e, self.hidden = e, hidden
        self.padded = hp = -(-hidden // BLOCK) * BLOCK  # the input and output width it runs at
        ip = -(-inter // BLOCK) * BLOCK
        unit = 127  # E8M0 code of 2^0
        gu_blocks = pad_to(w.gate_up_blocks.reshape(e, n2, kg * 16), 2, hp // 2)
        dn_blocks = pad_to(pad_to(w.down_blocks.reshape(e, hidden, -1), 2, ip // 2), 1, hp)
        self.fc1 = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(halves_padded(gu_blocks, ip), "fp4")
        self.fc2 = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(dn_blocks, "fp4")
        gu_scales = halves_padded(pad_to(w.gate_up_scales, 2, hp // GROUP, unit), ip, unit)
        dn_scales = pad_to(pad_to(w.down_scales, 2, ip // GROUP, unit), 1, hp, unit)
        self.scales = [fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=GROUP)
                       for s in (gu_scales, dn_scales)]
        self.fc1_bias = halves_padded(w.gate_up_bias.to(torch.bfloat16), ip)
        self.fc2_bias = pad_to(w.down_bias.to(torch.bfloat16), 1, hp)
        dev = w.gate_up_blocks.device
        self.alpha, self.beta, self.limit = (torch.full((e,), v, dtype=torch.float32, device=dev)
                                             for v in (1.702, 1.0, 7.0))


def forward(fused_moe, fw: FlashInferExperts, x: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
    """One MoE layer; x [t, padded] (zeros past the hidden size), out [t, padded]; the first `hidden` columns
    are the layer's output."""
    fused_moe.cutlass_fused_moe(
        input=x, token_selected_experts=ids, token_final_scales=wts, fc1_expert_weights=fw.fc1,
        fc2_expert_weights=fw.fc2, output_dtype=torch.bfloat16, quant_scales=[s.view(torch.int32) for s in fw.scales],
        fc1_expert_biases=fw.fc1_bias, fc2_expert_biases=fw.fc2_bias, swiglu_alpha=fw.alpha, swiglu_beta=fw.beta,
        swiglu_limit=fw.limit, use_w4_group_scaling=True, output=out)
    return out[:, :fw.hidden]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--no-autotune", action="store_true", help="FlashInfer's default tactic at every batch")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import flashinfer.fused_moe as fused_moe

    dev = torch.device("cuda")
    k = 4
    w, w_packed, g = random_layer(a.experts, dev)
    fw = FlashInferExperts(w, fused_moe)
    per_expert = expert_bytes(w)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; {a.experts} experts, "
          f"{per_expert / 1e6:.2f} MB each; flashinfer {getattr(sys.modules.get('flashinfer'), '__version__', '?')}",
          flush=True)
    rows = []
    for t in [int(v) for v in a.tokens.split(",")]:
        x, wts, id_sets, touched = layer_batch(t, a.experts, k, g)
        wts32 = wts.float()
        ids32 = [s.to(torch.int32) for s in id_sets]
        xp = pad_to(x, 1, fw.padded)
        out = torch.empty(t, fw.padded, dtype=torch.bfloat16, device=dev)
        if not a.no_autotune:
            from flashinfer.autotuner import autotune

            with autotune(True):  # picks and keeps the tactic of this shape
                forward(fused_moe, fw, xp, wts32, ids32[0], out)
            torch.cuda.synchronize()
        ref = experts_forward_mxfp4_ref(x, wts, id_sets[0], w).float()
        runs = {
            "pdserve (engine path)": (lambda s: experts_forward(x, wts, s, w_packed), id_sets),
            f"flashinfer cutlass ({fw.padded} wide)": (lambda s: forward(fused_moe, fw, xp, wts32, s, out), ids32),
        }
        errors = {name: float((fn(sets[0]).float() - ref).norm() / ref.norm()) for name, (fn, sets) in runs.items()}
        del ref
        time_runs(runs, errors, t, touched * per_expert / bw * 1e6, rows, "reference")
    save_rows(a.out, bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
