"""How many CTAs of each launch of one layer's attention half an SM holds, and whether a full layer's
attention CTA fits beside the QKV launch's: the occupancy queries behind docs/performance.md's
fifty-fourth round, for the shapes a 120b decode step launches at one request.

Under PDL the attention's CTAs are placed while the QKV launch's still run only on SMs with room for
them: shared memory (both asking for the same L1 split), registers and CTA slots. This prints, for
the QKV + RoPE launch in CTAs of 8 and 16 rows and the full layers' cluster attention with 1 and 2
blocks of keys a CTA, the CTAs an SM (`cuOccupancyMaxActiveBlocksPerMultiprocessor`), the
registers and shared memory behind it, and whether one attention CTA still fits on an SM that holds
as many QKV CTAs as it can.

    python -m pdserve.bench.occupancy [--k 2880] [--rows-qkv 5120]
"""

from __future__ import annotations

import argparse
import ctypes

import torch

from pdserve.kernels import cuda_decode_attention as da
from pdserve.kernels import cuda_gemv_fp8 as gf
from pdserve.kernels.nvrtc import resident_ctas

REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated to a warp in units of 256 (8 a thread)


def _attr(kernel, attribute: int) -> int:
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    value = ctypes.c_int()
    _check_cuda(_get_gpu_runtime_library().cuFuncGetAttribute(ctypes.byref(value), attribute, kernel.func))
    return value.value


def per_sm(kernel, threads: int, dynamic_smem: int) -> int:
    """CTAs of a build an SM holds at once (kernels.nvrtc.resident_ctas, per SM)."""
    dev = torch.cuda.current_device()
    return resident_ctas(kernel, threads, dynamic_smem, dev) // torch.cuda.get_device_properties(dev).multi_processor_count


def describe(name: str, kernel, threads: int, dynamic_smem: int) -> dict:
    """A build's resources a CTA (CU_FUNC_ATTRIBUTE 1: static shared memory, 4: registers)."""
    regs = _attr(kernel, 4)
    return {"name": name, "threads": threads, "registers": regs, "cta_registers": cta_registers(regs, threads),
            "shared": dynamic_smem + _attr(kernel, 1), "per_sm": per_sm(kernel, threads, dynamic_smem)}


def cta_registers(registers: int, threads: int) -> int:
    """Registers a CTA takes: each warp's rounded up to the allocation unit."""
    return -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT * threads // 32


def room_beside(full: dict, other: dict, shared_per_sm: int) -> tuple[int, int]:
    """(shared memory, registers) left on an SM holding `full`'s most CTAs (its per_sm) and one CTA of `other`
    (dicts of `describe`; the driver reserves 1 KB of shared memory a CTA): negative where it does not fit."""
    smem = shared_per_sm - full["per_sm"] * (full["shared"] + 1024) - (other["shared"] + 1024)
    regs = REGISTERS_PER_SM - full["per_sm"] * full["cta_registers"] - other["cta_registers"]
    return smem, regs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=2880, help="the QKV launch's K (gpt-oss' hidden size)")
    p.add_argument("--rows-qkv", type=int, default=5120, help="the QKV launch's rows (120b: (64 + 2 x 8) x 64)")
    a = p.parse_args()
    dev = torch.cuda.current_device()
    shared_per_sm = torch.cuda.get_device_properties(dev).shared_memory_per_multiprocessor
    qkv = []
    for rows in (8, 16):
        kernel = gf._build(dev, gf.GROUPS, gf.STREAM_DEPTH, False, rows)["gemv_fp8_rope"]
        qkv.append(describe(f"FP8 QKV + RoPE, {rows} rows ({a.rows_qkv // rows} CTAs)", kernel, 32 * gf.WARPS,
                            gf.shared_bytes(a.k, 1, rows)))
    attention = []
    for stages in (2, 1):
        cfg = da.ClusterConfig(16, stages, 2)
        attention.append(describe(f"attention, full layers, 16x{stages}", da._kernel(dev, 8, 16, cfg), da.THREADS,
                                  da.shared_bytes(cfg)))
    print(f"SM: {shared_per_sm} bytes of shared memory, {REGISTERS_PER_SM} registers")
    print("| build | registers | shared memory a CTA | CTAs an SM |")
    print("|---|---|---|---|")
    for d in qkv + attention:
        print(f"| {d['name']} | {d['registers']} | {d['shared']} | {d['per_sm']} |")
    print("\n| QKV build beside | attention | shared memory left (reserve 1 KB a CTA) | registers left | fits |")
    print("|---|---|---|---|---|")
    for q in qkv:
        for t in attention:
            smem_left, regs_left = room_beside(q, t, shared_per_sm)
            print(f"| {q['name']} x{q['per_sm']} | {t['name']} | {smem_left} | {regs_left} | "
                  f"{'yes' if smem_left >= 0 and regs_left >= 0 else 'no'} |")


if __name__ == "__main__":
    main()
