"""What a kernel boundary and a dependent read after it cost in a PDL chain, with nothing else in it.

A decode step is a chain of dependent kernels launched with programmatic dependent launch
(kernels/pdl.py): 8 a layer, each adding 1.6-18 us to a 120b layer of about 55 us (launch_ab
--timeline). This bench measures the chain's parts apart, so that a fusion is chosen from measured
costs: a chain of L kernels, each waiting for the one before (`griddepcontrol.wait`, then
`launch_dependents`), reading after its wait the value the kernel before wrote and then

- `hops` dependent reads through L2 (each address from the value the last one returned; every CTA
  its own chain of an L2-resident ring), the shape of a chain of loads after a wait;
- `stage` bytes a CTA read at once through L2 (16 bytes a thread, independent), the shape of a
  GEMV staging its token rows after its wait,

then CTA 0 writing the value the next kernel reads. Grids of 1, 132, 640 and 1440 CTAs of 128
threads (a norm, one CTA an SM, the FP8 QKV GEMV, one token's MXFP4 gate/up). Times: the chain
captured in one CUDA graph, median of replays, per kernel; with PDL and without.

    python -m pdserve.bench.pdl_chain [--kernels 64] [--out FILE.json]
    python -m pdserve.bench.pdl_chain --counters [--out FILE.json]
    python -m pdserve.bench.pdl_chain --overlap [--out FILE.json]
    python -m pdserve.bench.pdl_chain --carveout [--out FILE.json]
    python -m pdserve.bench.pdl_chain --barriers [--out FILE.json]
    python -m pdserve.bench.pdl_chain --clusters [--out FILE.json]

`--counters` asks what a boundary would cost without the grid-wide wait: the engine's order (wait,
then let the next kernel launch), the next kernel launched first (then wait), and a hand-off through
counters in global memory, where each kernel lets the next launch at its start and each CTA of the next
spins on a counter that every CTA of the one before increments when done (release / acquire at GPU
scope), with and without a pause between polls. A kernel whose CTAs are all placed can let the next
launch at its start without deadlock: the next is launched only once every CTA of this one has started.

`--barriers` asks what the same boundary costs inside one persistent kernel: a grid of 1 or 2 CTAs an SM
(all resident at once) runs `--kernels` phases, each the links' work (the read of the value CTA 0 wrote in
the phase before, then the hops or the staged bytes), separated by a grid-wide barrier in global memory
instead of a kernel boundary, the shape a whole-block kernel at one token (norm, QKV, attention, O, router)
would have. Barriers: thread 0 of each CTA adds itself to one counter (`red.release.gpu`) and polls it with
acquire loads; the same with relaxed polls and one acquire fence after them; or the last CTA to arrive
(`atom.acq_rel.gpu` returns it) raises a flag on another line that the others poll. Per phase from the
slope between 1 phase and `--kernels` phases (the launch and the counters' reset cancel out), beside the
PDL chain's per-kernel time at the same grid in the same run.

`--clusters` asks what a hand-off costs where the data a phase needs comes only from its own thread-block
cluster: the shape of a kernel whose steps depend on each other per KV head (QKV rows, attention, the O
projection's share of that head's columns) rather than across the grid. 128 CTAs in clusters of 2-16 run
`--kernels` phases, each the links' work with the value read from the cluster's first CTA's shared memory
(distributed shared memory) instead of global memory, separated by a cluster barrier
(`barrier.cluster` arrive.release / wait.acquire); per phase from the slope, beside the PDL chain and the grid
barrier at the same 128 CTAs in the same run.

`--overlap` asks instead whether a dependent kernel is placed while the kernel before it still runs,
which every read "ahead of the PDL wait" in the engine's kernels relies on: a one-CTA kernel that
spins 20 us (launched with PDL or without, letting its dependents launch at its start or not),
then a probe launched with PDL that records when its first CTA started and when its wait passed,
in us from the spin's start (a probe placed early starts near 0; one placed only when the spin has
finished, near 20). The probe as a plain 1-CTA kernel, with the attention's 76 KB of dynamic shared
memory, and as one cluster of 16 such CTAs; in a CUDA graph (as the engine replays its steps) and
eagerly.

`--carveout` asks whether a dependent is placed beside the CTAs of the kernel before it when the two
kernels' shared memory needs differ: an SM splits its L1 / shared-memory array between the two only
while it is idle, and the driver picks the split per kernel unless the kernel asks for one
(kernels/nvrtc.py, SMEM_CARVEOUT). The spin runs 2 CTAs of 512 threads an SM with 6 KB of shared memory
each (so the driver's split for it is small) and lets its dependents launch at its start; the probe is one CTA with the FP8 QKV GEMV's 34 KB or the
full layers' attention's 76 KB; both kernels with the driver's split, or both asking for all of the
array as shared memory.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

SOURCE = r"""
#include "cuda_common.cuh"

// prev: the value the kernel before wrote; ring [n] of next indices (n a power of two); row: bytes staged.
// sync: 0 none, 1 PDL as the engine's kernels (wait, then let the next launch), 2 PDL letting the next
// launch first, 3 counters: the next launches at once and each CTA spins (thread 0, `ld.acquire`, then
// `sleep_ns` between polls) until every CTA of the link before has counted itself (`red.release`) into
// counts[link - 1]. Link 0 waits as 1 does (whatever ran before the chain has no counter), resets the last
// two counters of the chain before it counts itself, link i >= 2 resets counts[i - 2] (every reader of it
// has finished): a replay leaves them zero.
extern "C" __global__ void __launch_bounds__(128) link(const u32* __restrict__ prev, u32* __restrict__ next,
                                                       const u32* __restrict__ ring, int n, int hops,
                                                       const unsigned char* __restrict__ row, int stage, int sync,
                                                       u32* counts, int index, int links, int prev_ctas,
                                                       int sleep_ns) {
  if (sync == 1 || (sync == 3 && index == 0)) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  } else if (sync == 2) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  } else if (sync == 3) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
      u32 c;
      while (true) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counts + index - 1) : "memory");
        if ((int)c >= prev_ctas) break;
        if (sleep_ns) __nanosleep(sleep_ns);
      }
    }
    __syncthreads();
  }
  if (sync == 3 && blockIdx.x == 0 && threadIdx.x == 0) {
    if (index == 0) {
      counts[links - 2] = 0;
      counts[links - 1] = 0;
    } else if (index >= 2) {
      counts[index - 2] = 0;
    }
  }
  u32 v = load_early_u32(prev);
  if (threadIdx.x == 0) {  // this CTA's chain of dependent reads
    u32 i = (v + blockIdx.x * 2654435761u) & (n - 1);
    for (int h = 0; h < hops; h++) i = load_early_u32(ring + i);
    v += i;
  }
  for (int o = threadIdx.x * 16; o < stage; o += 128 * 16) {  // one round of independent 16-byte reads
    const U4 r = load_early(row + o);
    v += r.x ^ r.y ^ r.z ^ r.w;
  }
  __shared__ u32 acc;
  if (threadIdx.x == 0) acc = 0;
  __syncthreads();
  atomicAdd(&acc, v);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) *next = acc & 1u;  // 0 or 1: the next kernel's start stays small
  if (sync == 3 && threadIdx.x == 0)  // after this thread's writes (and, by the barrier, the CTA's reads)
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counts + index) : "memory");
}
"""

BARRIER_SOURCE = r"""
#include "cuda_common.cuh"

// The barrier between phases: every CTA's thread 0 counts its CTA into count (monotonic over the launch:
// phase p is passed when it reaches (p + 1) * ctas), the others wait at the CTA barrier. kind 0: polls with
// acquire loads; 1: relaxed polls, then one acquire fence; 2: the CTA that arrives last (its atom returns
// (p + 1) * ctas - 1) raises flag to p + 1 with a release store, the others poll the flag (acquire).
__device__ __forceinline__ void grid_barrier(u32* count, u32* flag, u32 target, u32 phase, int kind) {
  __syncthreads();  // the CTA's reads and writes of the phase before its thread 0's release
  if (threadIdx.x == 0) {
    u32 c;
    if (kind == 2) {
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(c) : "l"(count) : "memory");
      if (c == target - 1) {
        asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flag), "r"(phase + 1) : "memory");
      } else {
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(flag) : "memory");
        } while (c < phase + 1);
      }
    } else {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(count) : "memory");
      if (kind == 0) {
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(count) : "memory");
        } while (c < target);
      } else {
        do {
          asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(count) : "memory");
        } while (c < target);
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
      }
    }
  }
  __syncthreads();
}

// A phase's work, a link's (kernel `link` above): from the value v the phase before left, thread 0's hops
// dependent L2 reads and stage bytes a CTA; the CTA's sum through acc (shared), returned to thread 0 (which
// alone zeroes acc for the next phase, so no other thread may read it late).
__device__ __forceinline__ u32 phase_work(u32 v, const u32* __restrict__ ring, int n, int hops,
                                          const unsigned char* __restrict__ row, int stage, u32* acc) {
  if (threadIdx.x == 0) {
    u32 i = (v + blockIdx.x * 2654435761u) & (n - 1);
    for (int h = 0; h < hops; h++) i = load_early_u32(ring + i);
    v += i;
  }
  for (int o = threadIdx.x * 16; o < stage; o += 128 * 16) {
    const U4 r = load_early(row + o);
    v += r.x ^ r.y ^ r.z ^ r.w;
  }
  if (threadIdx.x == 0) *acc = 0;
  __syncthreads();
  atomicAdd(acc, v);
  __syncthreads();
  return threadIdx.x == 0 ? *acc : 0u;
}

// `phases` phases of a link's work (kernel `link` above: the value CTA 0 wrote in the phase before, hops
// dependent L2 reads, stage bytes a CTA), a grid barrier after each but the last; sync[0] the counter, sync[1]
// the flag, both zero at the start (the caller resets them before each launch).
extern "C" __global__ void __launch_bounds__(128) phases(u32* __restrict__ vals, const u32* __restrict__ ring, int n,
                                                          int hops, const unsigned char* __restrict__ row, int stage,
                                                          int phases, int kind, u32* sync) {
  __shared__ u32 acc;
  for (int p = 0; p < phases; p++) {
    const u32 sum = phase_work(load_early_u32(vals + (p & 1)), ring, n, hops, row, stage, &acc);
    if (blockIdx.x == 0 && threadIdx.x == 0) vals[(p + 1) & 1] = sum & 1u;
    if (p + 1 < phases) grid_barrier(sync, sync + 1, (p + 1) * gridDim.x, p, kind);
  }
}

// *p in the shared memory of the cluster's CTA `rank`, as u32
__device__ __forceinline__ u32 peer_u32(const u32* p, u32 rank) {
  return __float_as_uint(load_peer(reinterpret_cast<const float*>(p), rank));
}

// `phases` phases of a link's work in thread-block clusters: the value the cluster's CTA 0 wrote into its
// shared memory in the phase before (vals[0] in the first), hops dependent L2 reads, stage bytes a CTA; a
// cluster barrier after each but the last. CTA 0 of the grid stores `phases` into vals[1] at the end.
extern "C" __global__ void __launch_bounds__(128) cluster_phases(u32* __restrict__ vals, const u32* __restrict__ ring,
                                                                  int n, int hops, const unsigned char* __restrict__ row,
                                                                  int stage, int phases) {
  __shared__ u32 acc, slot[2];
  const u32 rank = cluster_rank();
  for (int p = 0; p < phases; p++) {
    const u32 sum = phase_work(p == 0 ? load_early_u32(vals) : peer_u32(slot + (p & 1), 0), ring, n, hops, row, stage,
                               &acc);
    if (rank == 0 && threadIdx.x == 0) slot[(p + 1) & 1] = sum & 1u;
    if (p + 1 < phases) cluster_sync();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) vals[1] = (u32)phases;
  cluster_sync_relaxed();  // CTA 0's shared memory outlives its peers' last reads
}
"""

OVERLAP_SOURCE = r"""
#include "cuda_common.cuh"

// spins `ns` ns, its dependents allowed to launch at its start when `trigger`; stamp[0, 1]: its span
extern "C" __global__ void spin(int ns, unsigned long long* stamp, int trigger) {
  const unsigned long long t0 = now_ns();
  if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t;
  do {
    t = now_ns();
  } while (t - t0 < (unsigned long long)ns);
  if (threadIdx.x == 0) {
    stamp[0] = t0;
    stamp[1] = t;
  }
}

// stamp[2, 3]: when its first CTA started, and when that CTA's wait passed
extern "C" __global__ void probe(unsigned long long* stamp) {
  const unsigned long long t0 = now_ns();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const unsigned long long t1 = now_ns();
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    stamp[2] = t0;
    stamp[3] = t1;
  }
}
"""
SPIN_NS = 20_000
PROBE_SMEM = 76 * 1024  # the full layers' cluster attention's dynamic shared memory (two stages)
PROBES = {"1 CTA": (1, 0), "1 CTA, 76 KB shared": (1, PROBE_SMEM), "cluster of 16, 76 KB shared": (16, PROBE_SMEM)}

GRIDS = (1, 132, 640, 1440)
HOPS = (0, 1, 2, 4)
STAGES = (0, 5760, 23040)  # bytes a CTA: one token row of 2880 bf16, four of them
COUNTER_SLEEP_NS = 100


@functools.cache
def _kernel():
    from pdserve.kernels.nvrtc import compile_kernels

    return compile_kernels(SOURCE, ["link"], [], torch.cuda.current_device())["link"]


SYNCS = {"none": 0, "pdl": 1, "pdl, next launched first": 2, "counters": 3}


def chain_us(kernels: int, ctas: int, hops: int, stage: int, sync: str, replays: int = 20,
             sleep_ns: int = 0) -> float:
    """Median us a kernel of a graph-captured chain of `kernels` links, synchronised as SYNCS[sync]."""
    from pdserve.bench.kernels import graphed, time_it
    from pdserve.kernels.pdl import launch_cuda

    n = 1 << 20  # 4 MB of ring: resident in the L2
    ring = torch.randperm(n, device="cuda", dtype=torch.int64).to(torch.int32)
    row = torch.randint(0, 255, (max(stage, 16),), device="cuda", dtype=torch.uint8)
    vals = torch.zeros(2, dtype=torch.int32, device="cuda")
    counts = torch.zeros(kernels, dtype=torch.int32, device="cuda")
    k = _kernel()
    mode = SYNCS[sync]

    def run():
        for i in range(kernels):
            launch_cuda(k, (ctas, 1, 1), (128, 1, 1), 0, pdl=mode > 0,
                        args=[vals[i % 2:], vals[(i + 1) % 2:], ring, n, hops, row, stage, mode,
                              counts, i, kernels, ctas, sleep_ns])

    us = time_it(graphed(run), reps=replays, warmup=1, flush=False) * 1e6 / kernels
    torch.cuda.synchronize()
    if mode == 3 and (counts[:-2].count_nonzero().item() or counts[-2:].tolist() != [ctas, ctas]):
        raise RuntimeError(f"counters left at {counts.tolist()} after a replay")
    return us


BARRIERS = {"acquire polls": 0, "relaxed polls + fence": 1, "last arriver's flag": 2}
BARRIER_GRIDS = (1, 2, 3)  # CTAs an SM


@functools.cache
def _barrier_kernel():
    from pdserve.kernels.nvrtc import compile_kernels

    return compile_kernels(BARRIER_SOURCE, ["phases"], [], torch.cuda.current_device())["phases"]


def _phase_inputs(stage: int) -> tuple:
    """(n, ring, row, vals) of the persistent kernels: an L2-resident ring of n entries for the hops, a row of
    `stage` bytes, the two values the phases hand on."""
    n = 1 << 20
    ring = torch.randperm(n, device="cuda", dtype=torch.int64).to(torch.int32)
    row = torch.randint(0, 255, (max(stage, 16),), device="cuda", dtype=torch.uint8)
    return n, ring, row, torch.zeros(2, dtype=torch.int32, device="cuda")


def per_phase_us(launch_us, phases: int) -> float:
    """us a phase of a persistent kernel: the slope between a launch of one phase and one of `phases`
    (launch_us(p): us of a launch of p phases; the launch and its fixed costs cancel out)."""
    return (launch_us(phases) - launch_us(1)) / (phases - 1)


def barrier_launch_us(ctas: int, phases: int, hops: int, stage: int, kind: int, replays: int = 20) -> float:
    """Median us of one graph replay: the counters' reset, then one launch of `phases` phases."""
    from pdserve.bench.kernels import graphed, time_it
    from pdserve.kernels.pdl import launch_cuda

    n, ring, row, vals = _phase_inputs(stage)
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")

    def run():
        sync.zero_()
        launch_cuda(_barrier_kernel(), (ctas, 1, 1), (128, 1, 1), 0, pdl=False,
                    args=[vals, ring, n, hops, row, stage, phases, kind, sync])

    us = time_it(graphed(run), reps=replays, warmup=1, flush=False) * 1e6
    torch.cuda.synchronize()
    want = [(phases - 1) * ctas, phases - 1 if kind == 2 else 0]
    if sync.tolist() != want:
        raise RuntimeError(f"barrier counters {sync.tolist()} after a replay, expected {want}")
    return us


def barrier_us(ctas: int, phases: int, hops: int, stage: int, kind: int) -> float:
    """us a phase of the grid-barrier kernel (per_phase_us)."""
    return per_phase_us(lambda p: barrier_launch_us(ctas, p, hops, stage, kind), phases)


CLUSTER_CTAS = 128  # a whole number of clusters of every size below (each waits on itself only; where the GPCs
# hold fewer clusters of 16 at once, the later ones run after, and the slope counts both waves)
CLUSTER_SIZES = (2, 4, 8, 16)


@functools.cache
def _cluster_kernel(size: int):
    from pdserve.kernels.nvrtc import compile_kernels

    return compile_kernels(BARRIER_SOURCE, ["cluster_phases"], [], torch.cuda.current_device(),
                           cluster=size)["cluster_phases"]


def cluster_launch_us(size: int, phases: int, hops: int, stage: int, replays: int = 20) -> float:
    """Median us of one graph replay of one launch of `phases` phases in clusters of `size`."""
    from pdserve.bench.kernels import graphed, time_it
    from pdserve.kernels.pdl import launch_cuda

    n, ring, row, vals = _phase_inputs(stage)

    def run():
        launch_cuda(_cluster_kernel(size), (CLUSTER_CTAS, 1, 1), (128, 1, 1), 0, pdl=False,
                    args=[vals, ring, n, hops, row, stage, phases], cluster=(size, 1, 1))

    us = time_it(graphed(run), reps=replays, warmup=1, flush=False) * 1e6
    torch.cuda.synchronize()
    if int(vals[1]) != phases:
        raise RuntimeError(f"the cluster kernel ended with {int(vals[1])}, expected {phases}")
    return us


def clusters_main(phases: int, out: str | None) -> None:
    rows = []
    print(f"us a boundary at {CLUSTER_CTAS} CTAs: the PDL chain of {phases} kernels (a kernel), a persistent kernel of "
          f"{phases} phases (a phase: slope from 1 phase) with a grid barrier or a cluster barrier", flush=True)
    names = ["pdl chain", "grid barrier"] + [f"cluster barrier, {c} CTAs" for c in CLUSTER_SIZES]
    print(f"{'hops':>4} {'stage B':>8} " + " ".join(f"{n:>26}" for n in names), flush=True)
    for hops, stage in ((0, 0), (0, 5760), (2, 0)):
        us = [chain_us(phases, CLUSTER_CTAS, hops, stage, "pdl"), barrier_us(CLUSTER_CTAS, phases, hops, stage, 0)]
        us += [per_phase_us(lambda p, c=c: cluster_launch_us(c, p, hops, stage), phases) for c in CLUSTER_SIZES]
        rows.append({"hops": hops, "stage": stage, "us": dict(zip(names, us))})
        print(f"{hops:>4} {stage:>8} " + " ".join(f"{u:26.2f}" for u in us), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def barriers_main(phases: int, out: str | None) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = [k * sms for k in BARRIER_GRIDS]
    rows = []
    print(f"us a boundary: the PDL chain of {phases} kernels (a kernel), a persistent kernel of {phases} phases "
          f"(a phase: slope from 1 phase); columns: CTAs", flush=True)
    print(f"{'sync':>30} {'hops':>4} {'stage B':>8} " + " ".join(f"{c:>7}" for c in grids), flush=True)
    for hops, stage in ((0, 0), (0, 5760), (2, 0)):
        cases = [("pdl chain", lambda c: chain_us(phases, c, hops, stage, "pdl"))]
        cases += [(f"barrier, {name}", lambda c, kind=kind: barrier_us(c, phases, hops, stage, kind))
                  for name, kind in BARRIERS.items()]
        for name, fn in cases:
            us = [fn(c) for c in grids]
            rows.append({"sync": name, "hops": hops, "stage": stage, "us": dict(zip(grids, us))})
            print(f"{name:>30} {hops:>4} {stage:>8} " + " ".join(f"{u:7.2f}" for u in us), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


@functools.cache
def overlap_kernels(cluster: int = 1, smem: int = 0) -> dict:
    """The spin and the probe, the probe allowed `smem` bytes of dynamic shared memory and clusters of
    `cluster` CTAs (bench/attention_trace.py spins before the attention with the same kernel)."""
    from pdserve.kernels.nvrtc import compile_kernels

    return compile_kernels(OVERLAP_SOURCE, ["spin", "probe"], ["-std=c++17"], torch.cuda.current_device(),
                           dynamic_smem=smem, cluster=cluster)


def overlap_us(graph: bool, spin_pdl: bool, trigger: bool, probe: str, reps: int = 5) -> tuple[float, float, float]:
    """(probe started, its wait passed, the spin ended), us from the spin's start; medians of `reps`."""
    from pdserve.bench.kernels import QUEUE_SLEEP, graphed
    from pdserve.kernels.pdl import launch_cuda

    cluster, smem = PROBES[probe]
    k = overlap_kernels(cluster, smem)
    stamp = torch.zeros(4, dtype=torch.int64, device="cuda")

    def run():
        launch_cuda(k["spin"], (1, 1, 1), (32, 1, 1), 0, pdl=spin_pdl, args=[SPIN_NS, stamp, int(trigger)])
        launch_cuda(k["probe"], (cluster, 1, 1), (128, 1, 1), smem, pdl=True, args=[stamp],
                    cluster=(cluster, 1, 1) if cluster > 1 else None)

    step = graphed(run) if graph else run
    got = []
    for _ in range(reps):
        torch.cuda._sleep(QUEUE_SLEEP)  # the host queues both launches meanwhile
        step()
        torch.cuda.synchronize()
        t = stamp.tolist()
        got.append(tuple((v - t[0]) / 1e3 for v in (t[2], t[3], t[1])))
    return tuple(sorted(x[i] for x in got)[reps // 2] for i in range(3))


CARVEOUT_SPIN_SMEM = 6 * 1024  # about MXFP4 down's (one pair's staged row)
CARVEOUT_PROBES = (34 * 1024, PROBE_SMEM)


@functools.cache
def carveout_kernels(smem: int, carveout: int | None) -> dict:
    """A fresh build of the spin and the probe (the probe allowed `smem` bytes), both asking for
    `carveout` percent of shared memory (None: the driver's choice)."""
    import ctypes

    from pdserve.kernels.nvrtc import compile_kernels
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    k = compile_kernels(OVERLAP_SOURCE + f"\n// build {smem} {carveout}\n", ["spin", "probe"], ["-std=c++17"],
                        torch.cuda.current_device(), dynamic_smem=smem)
    if carveout is not None:
        for f in k.values():
            _check_cuda(_get_gpu_runtime_library().cuFuncSetAttribute(f.func, 9, ctypes.c_int(carveout)))
    return k


def carveout_us(smem: int, carveout: int | None, reps: int = 5) -> tuple[float, float, float]:
    """(probe started, its wait passed, the spin ended), us from the spin's start, the spin 2 CTAs an SM."""
    from pdserve.bench.kernels import QUEUE_SLEEP, graphed
    from pdserve.kernels.pdl import launch_cuda

    k = carveout_kernels(smem, carveout)
    ctas = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    stamp = torch.zeros(4, dtype=torch.int64, device="cuda")

    def run():
        launch_cuda(k["spin"], (ctas, 1, 1), (512, 1, 1), CARVEOUT_SPIN_SMEM, pdl=True, args=[SPIN_NS, stamp, 1])
        launch_cuda(k["probe"], (1, 1, 1), (128, 1, 1), smem, pdl=True, args=[stamp])

    step = graphed(run)
    got = []
    for _ in range(reps):
        torch.cuda._sleep(QUEUE_SLEEP)
        step()
        torch.cuda.synchronize()
        t = stamp.tolist()
        got.append(tuple((v - t[0]) / 1e3 for v in (t[2], t[3], t[1])))
    return tuple(sorted(x[i] for x in got)[reps // 2] for i in range(3))


def carveout_main(out: str | None) -> None:
    rows = []
    print(f"us from the spin's start (it spins {SPIN_NS / 1e3:.0f} us, 2 CTAs of 512 threads an SM with "
          f"{CARVEOUT_SPIN_SMEM // 1024} KB shared each); the probe one CTA, launched with PDL", flush=True)
    for smem in CARVEOUT_PROBES:
        for carveout in (None, 100):
            started, passed, ended = carveout_us(smem, carveout)
            rows.append({"probe_smem": smem, "carveout": carveout, "started": started, "passed": passed,
                         "spin_ended": ended})
            print(f"probe {smem // 1024:3d} KB shared, carveout {'driver' if carveout is None else carveout:>6}: "
                  f"probe started {started:6.2f}  wait passed {passed:6.2f}  spin ended {ended:6.2f}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def overlap_main(out: str | None) -> None:
    rows = []
    print(f"us from the spin's start (it spins {SPIN_NS / 1e3:.0f} us); the probe launched with PDL", flush=True)
    for graph in (True, False):
        for spin_pdl in (True, False):
            for trigger in (True, False):
                for probe in PROBES:
                    if not graph and probe != "1 CTA":
                        continue
                    started, passed, ended = overlap_us(graph, spin_pdl, trigger, probe)
                    rows.append({"graph": graph, "spin_pdl": spin_pdl, "trigger": trigger, "probe": probe,
                                 "started": started, "passed": passed, "spin_ended": ended})
                    print(f"{'graph' if graph else 'eager':5}  spin {'with' if spin_pdl else 'without'} PDL, "
                          f"{'triggers' if trigger else 'no trigger'}  {probe:28s} probe started {started:6.2f}  "
                          f"wait passed {passed:6.2f}  spin ended {ended:6.2f}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=64, help="links a chain")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--overlap", action="store_true", help="whether a dependent launch is placed early (see above)")
    ap.add_argument("--counters", action="store_true", help="the engine's PDL boundary against a hand-off "
                    "through counters in global memory (see above)")
    ap.add_argument("--carveout", action="store_true", help="whether a dependent is placed beside CTAs of "
                    "another shared-memory split (see above)")
    ap.add_argument("--barriers", action="store_true", help="the PDL boundary against grid barriers inside one "
                    "persistent kernel (see above)")
    ap.add_argument("--clusters", action="store_true", help="the PDL boundary against cluster barriers inside "
                    "one persistent kernel, data from the cluster only (see above)")
    a = ap.parse_args()
    if a.clusters:
        clusters_main(a.kernels, a.out)
        return
    if a.barriers:
        barriers_main(a.kernels, a.out)
        return
    if a.carveout:
        carveout_main(a.out)
        return
    if a.overlap:
        overlap_main(a.out)
        return
    rows = []
    print(f"us a kernel, chains of {a.kernels}; columns: CTAs", flush=True)
    print(f"{'sync':>30} {'hops':>4} {'stage B':>8} " + " ".join(f"{c:>7}" for c in GRIDS), flush=True)
    if a.counters:
        cases = [(sync, sleep, hops, stage) for hops, stage in ((0, 0), (0, 5760), (2, 0))
                 for sync, sleep in (("pdl", 0), ("pdl, next launched first", 0), ("counters", 0),
                                     ("counters", COUNTER_SLEEP_NS))]
    else:
        cases = [(sync, 0, hops, stage) for sync in ("pdl", "none") for hops in HOPS for stage in STAGES
                 if not (hops and stage)]
    for sync, sleep, hops, stage in cases:
        us = [chain_us(a.kernels, c, hops, stage, sync, sleep_ns=sleep) for c in GRIDS]
        name = sync + (f", polls {sleep} ns apart" if sleep else "")
        rows.append({"sync": name, "hops": hops, "stage": stage, "us": dict(zip(GRIDS, us))})
        print(f"{name:>30} {hops:>4} {stage:>8} " + " ".join(f"{u:7.2f}" for u in us), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
