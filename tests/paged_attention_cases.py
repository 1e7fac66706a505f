"""gpt-oss attention shapes, random paged batches and the float32 reference, shared by the GPU tests
of the sink-attention kernels (tests/gpu/test_attention_gpu.py, test_triton_decode_attention_gpu.py)."""

from __future__ import annotations

import math

import torch

import numerics
from pdserve.bench.kernels import scattered_batch
from pdserve.kernels.attention import TorchSinkAttention

HQ, HKV, D, PAGE = 64, 8, 64, 16
SM_SCALE = 1 / math.sqrt(D)
DEV = torch.device("cuda")


def rel_l2(out, ref):
    assert not out.isnan().any(), "NaN in output (unwritten element)"
    return numerics.rel_l2(out, ref)


def random_batch(qo_lens, kv_lens, gen, spare_pages=7):
    """Requests on randomly scattered pages of one pool (page 0 kept free for graph padding)."""
    batch, total = scattered_batch(qo_lens, kv_lens, PAGE, gen, spare_pages)
    kv = torch.randn(total, 2, PAGE, HKV, D, generator=gen).to(DEV, torch.bfloat16)
    q = torch.randn(sum(qo_lens), HQ, D, generator=gen).to(DEV, torch.bfloat16)
    return batch, kv, q


def sinks_for(gen):
    return (torch.randn(HQ, generator=gen) * 2).to(DEV, torch.float32)


def reference(batch, q, kv, sinks, window_left):
    ref = TorchSinkAttention(window_left, SM_SCALE)
    ref.plan(batch)
    return ref.run(q, kv, sinks)
