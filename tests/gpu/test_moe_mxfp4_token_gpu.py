"""One token's MXFP4 MoE in one launch of resident CTAs (cuda_moe_mxfp4.experts_forward_mxfp4_token,
the .cu file's mx_moe_token) on the GPU, gpt-oss' expert shapes (32 and 128 experts, top 4), fresh
random weights and routing: against `experts_forward_ref` in float32 on the exactly dequantised
weights (rel L2 4e-3, the per-pair kernels' bound: f16 SwiGLU activations and a bf16 output) and
against the per-pair launches (the same numbers summed in another order); bit-identical from call to
call, over consecutive calls (its counters are reset by their last user), and replayed from a graph
on new inputs; the engine's step with it agrees with the per-pair step and replays bit for bit."""

from __future__ import annotations

import pytest
import torch

from mxfp4_layers import random_layer, reference
from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _needs_kernels():
    from pdserve.kernels import cuda_moe_mxfp4

    if not cuda_moe_mxfp4.available(DEV):
        pytest.skip("the mma kernels need Hopper and NVRTC")


def _case(e: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = random_layer(e, g, DEV)
    x = torch.randn(1, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.randperm(e, device=DEV, generator=g)[:4][None]
    weights = torch.softmax(torch.randn(1, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    return w, x, ids, weights


@pytest.mark.parametrize("e", [32, 128])
@pytest.mark.parametrize("config", [None, (4, 4, 4), (8, 6, 2), (8, 8, 1)])
def test_token_kernel_against_reference(e, config, seed):
    from pdserve.kernels.cuda_moe_mxfp4 import experts_forward_mxfp4_mma, experts_forward_mxfp4_token

    w, x, ids, weights = _case(e, seed)
    wp = w.to_packed()
    out = experts_forward_mxfp4_token(x, weights, ids, wp, config=config)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_l2(out, reference(x, weights, ids, w)) < 4e-3, rel_l2(out, reference(x, weights, ids, w))
    assert rel_l2(out, experts_forward_mxfp4_mma(x, weights, ids, wp)) < 4e-3
    for _ in range(3):  # consecutive launches: the counters are left zero by each
        assert torch.equal(experts_forward_mxfp4_token(x, weights, ids, wp, config=config), out)
    nobias = experts_forward_mxfp4_token(x, weights, ids, wp, add_down_bias=False, config=config)
    assert rel_l2(nobias, reference(x, weights, ids, w, bias=False)) < 4e-3


def test_token_kernel_graph_replay(seed):
    from pdserve.kernels.cuda_moe_mxfp4 import experts_forward_mxfp4_token

    w, x, ids, weights = _case(128, seed)
    wp = w.to_packed()
    experts_forward_mxfp4_token(x, weights, ids, wp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward_mxfp4_token(x, weights, ids, wp)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    for _ in range(3):
        x.copy_(torch.randn(1, 2880, device=DEV, generator=g))
        ids.copy_(torch.randperm(128, device=DEV, generator=g)[:4][None])
        weights.copy_(torch.softmax(torch.randn(1, 4, device=DEV, generator=g), -1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, experts_forward_mxfp4_token(x, weights, ids, wp))
        assert rel_l2(out, reference(x, weights, ids, w)) < 4e-3


def test_engine_step_with_the_token_kernel(tmp_path, monkeypatch, seed):
    """A 2-layer random model with I = H (the kernel takes gate/up's K equal to down's, as gpt-oss'):
    the decode step with the token kernel against the per-pair launches, eager, and replayed from a
    graph bit for bit."""
    pytest.importorskip("flashinfer")
    import dataclasses

    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence
    from pdserve.kernels import cuda_moe_mxfp4, moe

    cfg = dataclasses.replace(preset("20b"), hidden_size=640, intermediate_size=640, num_hidden_layers=2,
                              num_local_experts=8, layer_types=())
    ckpt = make_random_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    calls = []
    real = cuda_moe_mxfp4.experts_forward_mxfp4_token
    monkeypatch.setattr(cuda_moe_mxfp4, "experts_forward_mxfp4_token", lambda *a, **k: calls.append(1) or real(*a, **k))

    def decode(token_kernel: bool, graphs: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(moe, "MXFP4_TOKEN_KERNEL", token_kernel)
        r = ModelRunner(str(ckpt), device="cuda", precision="mxfp4", num_kv_blocks=128,
                        cuda_graph_max_batch=1 if graphs else 0)
        gen = torch.Generator().manual_seed(seed)
        s = Sequence("r0", torch.randint(0, 201088, (37,), generator=gen).tolist(),
                     SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
        s.blocks = r.cache.reserve(s.max_tokens, 37)
        s.append(int(r.prefill(s).argmax()), (), r.max_context)
        out = []
        for _ in range(4):
            logits = r.decode([s])
            out.append(logits.float().clone())
            s.append(int(logits.argmax()), (), r.max_context)
        return out

    pair = decode(False, graphs=False)
    assert not calls
    token = decode(True, graphs=False)
    assert len(calls) >= 4 * 2  # every decode step's layers
    replayed = decode(True, graphs=True)
    for a, b, c in zip(token, pair, replayed):
        assert rel_l2(a, b) < 2e-2, rel_l2(a, b)
        assert torch.equal(a, c)
