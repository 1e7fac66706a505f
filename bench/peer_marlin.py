"""Same-run peer for the MXFP4 decode MoE: vLLM's Marlin MoE (`moe_wna16_marlin_gemm`: W4A16 through
mma.sync, the weights repacked into Marlin's tile order, one launch for gate/up and one for down,
each block of rows of an expert striped over the SMs) on the same experts, routing sets and timing
as bench/moe_mxfp4.py, against the path pdserve's engine takes (`kernels.moe.experts_forward`).

    python bench/peer_marlin.py --vllm DIR [--experts 128] [--tokens 1,2,4,8,16,64] [--pad 2944,2880]

DIR is the `vllm/` folder of vLLM's wheel (`pip download --no-deps vllm`, then unzip it): the bench
loads `_moe_C_stable_libtorch.abi3.so` from it (built on torch's stable ABI, so it loads into a torch
that exports the same shims; no vLLM import) and `scalar_type.py` (the id of `float4_e2m1f`). The
repack into Marlin's order is done here in torch (`marlin_tile_order`), since vLLM's repack op lives
in its larger `_C` library.

Marlin needs (N % 128, K % 64) or (N % 64, K % 128), so gpt-oss' 2880 is padded with zero weights:
`--pad H,I`, by default as vLLM pads them for Marlin (hidden to a multiple of 256, intermediate of 128:
3072, 2944); 2944,2880 is the least Marlin takes. The peer's rows report time for its two GEMMs and
the routing layout they read ("marlin gemms") and for the whole MoE with the clamped SwiGLU and the
top-k sum in torch ("marlin whole"); of floor = the routed experts' unpadded MXFP4 bytes / copy
bandwidth over the time, as in bench/moe_mxfp4.py. rel L2 is each output against
`experts_forward_mxfp4_ref` (the experts decoded exactly, bf16 arithmetic), so a wrong repack shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import copy_bandwidth  # noqa: E402
from pdserve.bench.moe_mxfp4 import expert_bytes, layer_batch, random_layer, save_rows, time_runs  # noqa: E402
from pdserve.kernels.experts import experts_forward_mxfp4_ref  # noqa: E402
from pdserve.kernels.cuda_moe_mxfp4 import experts_forward_mxfp4_mma  # noqa: E402
from pdserve.kernels.moe import MXFP4_MMA_GROUPED_FROM, experts_forward  # noqa: E402
from pdserve.kernels.mxfp4 import MxExperts, unpack_fp4_codes  # noqa: E402

TILE = 16  # Marlin's weight tiles are 16 (K) x 64 (N) codes


def marlin_weight_perm() -> torch.Tensor:
    """Order of the 1024 codes of a 16 x 64 tile in Marlin's 4-bit layout (16-bit activations): each
    thread's mma fragment rows, interleaved so that one shift-and-mask yields two operands."""
    perm = []
    for i in range(32):
        col = i // 4
        lane = [16 * row + col + 8 * block for block in (0, 1)
                for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)]
        for j in range(4):
            perm.extend(p + 256 * j for p in lane)
    return torch.tensor(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)


def marlin_tile_order(codes: torch.Tensor) -> torch.Tensor:
    """One expert's e2m1 codes [N, K] (0-15) as Marlin's int32 [K / 16, 2 N]: 16 x 64 tiles, each
    permuted by `marlin_weight_perm`, 8 codes a word, lowest first."""
    n, k = codes.shape
    q = codes.t().to(torch.int64).reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3)
    q = q.reshape(k // TILE, -1, 1024)[..., marlin_weight_perm().to(codes.device)].reshape(k // TILE, 2 * n, 8)
    word = sum(q[..., i] << (4 * i) for i in range(8))
    return word.to(torch.int32)  # wraps the top nibble into the sign bit, as Marlin reads it


def marlin_group_order(s: torch.Tensor) -> torch.Tensor:
    """Per-group values [K / 32, N] in Marlin's order for grouped scales (8 x 8 blocks transposed, then
    the MXFP4 path's swap of the middle two of each four for 16-bit activations)."""
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    rows = s.shape[0]
    s = s.reshape(-1, 64)[:, perm].reshape(rows, -1)
    return s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(rows, -1)


def marlin_bias_order(b: torch.Tensor) -> torch.Tensor:
    perm = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return b.reshape(-1, 32)[:, perm].reshape(b.shape)


class MarlinExperts:
    """`w` padded to (hidden, intermediate) and repacked for `moe_wna16_marlin_gemm`."""

    def __init__(self, w: MxExperts, hidden: int, inter: int):
        e, h, i = w.num_experts, w.down_blocks.shape[1], w.gate_up_blocks.shape[1] // 2
        self.e, self.h, self.i, self.hp, self.ip = e, h, i, hidden, inter
        dev = w.gate_up_bias.device

        def pad_codes(blocks, rows, cols, rows_to, cols_to):
            codes = unpack_fp4_codes(blocks).reshape(rows, cols)  # [rows, cols] 0-15
            out = torch.zeros(rows_to, cols_to, dtype=codes.dtype, device=dev)
            out[:rows, :cols] = codes
            return out

        def pad_scales(scales, rows, rows_to, groups_to):
            out = torch.full((rows_to, groups_to), 127, dtype=torch.uint8, device=dev)  # 2^0 on zero codes
            out[:rows, :scales.shape[-1]] = scales
            return out

        gu_w, gu_s, dn_w, dn_s = [], [], [], []
        for x in range(e):
            # gate/up rows stay interleaved (gate, up, ...): padding adds (gate, up) pairs of zeros
            gu_w.append(marlin_tile_order(pad_codes(w.gate_up_blocks[x], 2 * i, h, 2 * inter, hidden)))
            gu_s.append(marlin_group_order(pad_scales(w.gate_up_scales[x], 2 * i, 2 * inter, hidden // 32).t()))
            dn_w.append(marlin_tile_order(pad_codes(w.down_blocks[x], h, i, hidden, inter)))
            dn_s.append(marlin_group_order(pad_scales(w.down_scales[x], h, hidden, inter // 32).t()))
        e8m0 = torch.float8_e8m0fnu
        self.gate_up = torch.stack(gu_w)
        self.gate_up_scales = torch.stack(gu_s).contiguous().view(e8m0)
        self.down = torch.stack(dn_w)
        self.down_scales = torch.stack(dn_s).contiguous().view(e8m0)
        gub = torch.zeros(e, 2 * inter, device=dev)
        gub[:, :2 * i] = w.gate_up_bias
        dnb = torch.zeros(e, hidden, device=dev)
        dnb[:, :h] = w.down_bias
        self.gate_up_bias = torch.stack([marlin_bias_order(b) for b in gub.to(torch.bfloat16)])
        self.down_bias = torch.stack([marlin_bias_order(b) for b in dnb.to(torch.bfloat16)])


class MarlinMoE:
    """The peer's forward as vLLM runs it for MXFP4 experts with 16-bit activations: routing layout
    (`moe_align_block_size`), gate/up GEMM with bias, activation, down GEMM with bias times the
    routing weight, sum over the top k."""

    def __init__(self, lib: Path, scalar_type: Path, device: torch.device):
        torch.ops.load_library(str(lib))
        spec = importlib.util.spec_from_file_location("vllm_scalar_type", scalar_type)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        self.fp4_id = mod.scalar_types.float4_e2m1f.id
        self.ops = torch.ops._moe_C
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.workspace = torch.zeros(sms * 16, dtype=torch.int32, device=device)

    @staticmethod
    def block_size(tokens: int, top_k: int, experts: int) -> int:
        """Rows of a routing block, chosen as vLLM chooses it (the smallest that the average expert
        fills to at least 90 %)."""
        for bm in (8, 16, 32, 48, 64):
            if tokens * top_k / experts / bm < 0.9:
                return bm
        return 64

    def gemms(self, x, wts, ids, m: MarlinExperts):
        """The routing layout and the gate/up GEMM; returns its output per pair and the down GEMM as a
        function of the activations (computed between them by `forward`)."""
        t, k = ids.shape
        bm = self.block_size(t, k, m.e)
        padded = min(ids.numel() + m.e * (bm - 1), ids.numel() * bm)
        sorted_ids = torch.empty(padded, dtype=torch.int32, device=x.device)
        expert_ids = torch.empty((padded + bm - 1) // bm, dtype=torch.int32, device=x.device)
        post_pad = torch.empty(1, dtype=torch.int32, device=x.device)
        self.ops.moe_align_block_size(ids, m.e, bm, sorted_ids, expert_ids, post_pad, None, None)
        wts32 = wts.float()

        def gemm(a, out, w, bias, scales, top_k, mul, size_m, size_n, size_k):
            return self.ops.moe_wna16_marlin_gemm(
                a, out, w, bias, scales, None, None, None, self.workspace, sorted_ids, expert_ids, post_pad, wts32,
                bm, top_k, mul, self.fp4_id, size_m, size_n, size_k, False, True, False, -1, -1, -1)

        gate_up = gemm(x, torch.empty(t * k, 2 * m.ip, dtype=x.dtype, device=x.device), m.gate_up, m.gate_up_bias,
                       m.gate_up_scales, k, False, t, 2 * m.ip, m.hp)
        return gate_up, lambda act: gemm(act, torch.empty(t * k, m.hp, dtype=x.dtype, device=x.device), m.down,
                                         m.down_bias, m.down_scales, 1, True, t * k, m.hp, m.ip)

    def forward(self, x, wts, ids, m: MarlinExperts, limit: float = 7.0, alpha: float = 1.702):
        t, k = ids.shape
        xp = torch.nn.functional.pad(x, (0, m.hp - m.h))
        gate_up, down = self.gemms(xp, wts, ids, m)
        gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
        act = (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(x.dtype)
        return down(act).view(t, k, m.hp).sum(1)[:, :m.h]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", required=True, type=Path, help="the vllm/ folder of vLLM's unpacked wheel")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--pad", default="3072,2944", help="hidden,intermediate sizes Marlin's weights are padded to")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    h = 2880
    e, k = a.experts, 4
    w, w_packed, g = random_layer(e, dev)
    hp, ip = (int(v) for v in a.pad.split(","))
    peer = MarlinMoE(a.vllm / "_moe_C_stable_libtorch.abi3.so", a.vllm / "scalar_type.py", dev)
    marlin = MarlinExperts(w, hp, ip)
    per_expert = expert_bytes(w)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; {e} experts, "
          f"{per_expert / 1e6:.2f} MB each; Marlin padded to {hp},{ip}", flush=True)
    rows = []
    for t in [int(v) for v in a.tokens.split(",")]:
        x, wts, id_sets, touched = layer_batch(t, e, k, g)
        floor_us = touched * per_expert / bw * 1e6
        ref = experts_forward_mxfp4_ref(x, wts, id_sets[0], w).float()
        xp = torch.nn.functional.pad(x, (0, hp - h))
        act = torch.zeros(t * k, ip, dtype=x.dtype, device=dev)
        ids32 = [s.to(torch.int32) for s in id_sets]  # the routing ids vLLM's top-k writes
        runs = {
            "pdserve (engine path)": (lambda s: experts_forward(x, wts, s, w_packed), id_sets),
            "pdserve mma direct": (lambda s: experts_forward_mxfp4_mma(x, wts, s, w_packed, grouped=t >= MXFP4_MMA_GROUPED_FROM),
                                   id_sets),
            "marlin whole": (lambda s: peer.forward(x, wts, s, marlin), ids32),
            "marlin gemms": (lambda s: peer.gemms(xp, wts, s, marlin)[1](act), ids32),
        }
        errors = {name: float("nan") if name == "marlin gemms" else
                  float((fn(sets[0]).float() - ref).norm() / ref.norm()) for name, (fn, sets) in runs.items()}
        del ref
        time_runs(runs, errors, t, floor_us, rows, "reference")
    save_rows(a.out, bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
