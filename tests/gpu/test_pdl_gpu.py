"""Programmatic dependent launch (kernels/pdl.py) changes when the decode step's kernels start, never
what they compute: with it on, every step's logits equal those with it off bit for bit, eagerly and
replayed from CUDA graphs, in both expert precisions (FP8 GEMV / grouped kernels, MXFP4 mma kernels),
over batch sizes that take the GEMV and grouped paths. A kernel that read its predecessor's output
before `griddepcontrol.wait` would race and show up here as a mismatch; the kernels that read ahead
of the wait (the decode attention's first block of keys, whose last key the QKV epilogue just wrote,
the router's, GEMV's and MXFP4 down projection's weights) run with those reads on."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.kernels import pdl

pytestmark = [
    pytest.mark.gpu,  # tests/conftest.py skips it where no CUDA GPU is
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                       reason="programmatic dependent launch needs Hopper or newer"),
]

pytest.importorskip("flashinfer")


@pytest.fixture
def pdl_on(monkeypatch):
    """PDL on, whatever the caller's environment says (a test turns it off with PDSERVE_PDL=0 for its baseline)."""


def _prompts(batch: int) -> list[list[int]]:
    """`batch` prompts of 3-299 random ids, from a fresh seed."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    return [torch.randint(0, 201088, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 300, (batch,), generator=gen)]


def _decode_logits(ckpt, precision: str, graphs: bool, prompts, steps: int, attention_precision: str = "bf16",
                   **model_options) -> list[torch.Tensor]:
    """Each decode step's logits; model_options: GptOssModel's launch options (early_router_launch, ...)."""
    batch_size = len(prompts)
    r = ModelRunner(str(ckpt), device="cuda", precision=precision, num_kv_blocks=512, attention_precision=attention_precision)
    for name, value in model_options.items():
        assert hasattr(r.model, name), name
        setattr(r.model, name, value)
    if graphs:  # captured with the options set (a runner built with graphs captures them at its start)
        r.decode_graphs = DecodeGraphs(r.model, r.cache, batch_size, max_context=r.max_context)
        r.decode_graphs.capture_all()
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(f"r{i}", list(p), SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True))
        s.blocks = r.cache.reserve(s.max_tokens, len(p))
        s.append(int(r.prefill(s).argmax()), (), r.max_context)
        seqs.append(s)
    out = []
    for _ in range(steps):
        logits = r.decode(seqs)
        out.append(logits.clone())
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t, (), r.max_context)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("precision", ["fp8", "mxfp4"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("batch", [1, 6])
def test_pdl_decode_is_bit_identical(narrow_ckpt, pdl_on, monkeypatch, precision, graphs, batch):
    assert pdl.enabled(torch.device("cuda"))
    prompts = _prompts(batch)
    with_pdl = _decode_logits(narrow_ckpt, precision, graphs, prompts, steps=6)
    monkeypatch.setenv("PDSERVE_PDL", "0")
    assert not pdl.enabled(torch.device("cuda"))
    without = _decode_logits(narrow_ckpt, precision, graphs, prompts, steps=6)
    for step, (a, b) in enumerate(zip(with_pdl, without)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"step {step}: PDL changed the logits"


@pytest.mark.parametrize("precision", ["fp8", "mxfp4"])
@pytest.mark.parametrize("batch", [1, 6])
def test_router_launched_at_the_norms_start_keeps_the_decode_step(narrow_ckpt, pdl_on, monkeypatch, precision, batch):
    """GptOssModel.early_router_launch (off by default; the benchmark's A/B): the norm before each MoE block
    lets the router launch at the norm's start, as kernels/pdl.py's exception allows for a kernel that reads
    only weights ahead of its wait. The eager step's logits equal those with PDL off, bit for bit."""
    prompts = _prompts(batch)
    early = _decode_logits(narrow_ckpt, precision, False, prompts, steps=6, early_router_launch=True)
    monkeypatch.setenv("PDSERVE_PDL", "0")
    without = _decode_logits(narrow_ckpt, precision, False, prompts, steps=6)
    for step, (a, b) in enumerate(zip(early, without)):
        assert torch.equal(a, b), f"step {step}: the early router launch changed the logits"


@pytest.mark.parametrize("attention_precision", ["bf16", "fp8"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_output_projection_launched_at_the_attentions_start_keeps_the_decode_step(narrow_ckpt, pdl_on, monkeypatch,
                                                                                  attention_precision, graphs, batch):
    """GptOssModel.early_o_launch: the cluster decode attention lets the output projection launch at its start
    where that projection is the staged bf16 GEMV (one token) or the FP8 GEMV (up to four), both reading only
    weights ahead of their wait (kernels/pdl.py's exception). Every step's logits equal those with PDL off, bit
    for bit, eagerly and replayed; and the early launch is taken at one token in both precisions."""
    from pdserve.kernels import cuda_decode_attention as cda

    taken = []
    launch = cda.decode_attention
    monkeypatch.setattr(cda, "decode_attention", lambda *a, **k: taken.append(k.get("early_launch")) or launch(*a, **k))
    prompts = _prompts(batch)
    early = _decode_logits(narrow_ckpt, "mxfp4", graphs, prompts, steps=6, attention_precision=attention_precision,
                           early_o_launch=True)
    if batch == 1:
        assert any(taken), "the attention never let the output projection launch at its start"
    monkeypatch.setenv("PDSERVE_PDL", "0")
    without = _decode_logits(narrow_ckpt, "mxfp4", graphs, prompts, steps=6, attention_precision=attention_precision)
    for step, (a, b) in enumerate(zip(early, without)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"step {step}: the early output projection launch changed the logits"


@pytest.mark.parametrize("plan,evict_first", [({"down": "qkv"}, False), ({"down": "qkv"}, True),
                                               ({"gate_up": "qkv", "down": "o"}, True)])
@pytest.mark.parametrize("graphs", [False, True])
def test_next_layer_weights_prefetched_into_l2_keep_the_decode_step(narrow_ckpt, pdl_on, monkeypatch, graphs, plan,
                                                                    evict_first):
    """GptOssModel.prefetch_next: the MXFP4 launches of each MoE request the next layer's FP8 QKV / O weights into
    L2 ahead of their wait, also with the experts' weights read under L2's evict-first policy
    (cuda_moe_mxfp4.EVICT_FIRST); hints to the memory system only, so every step's logits equal those without them
    and with PDL off, bit for bit."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    monkeypatch.setattr(cm, "EVICT_FIRST", evict_first)
    asked = []
    forward = cm.experts_forward_mxfp4_mma
    monkeypatch.setattr(cm, "experts_forward_mxfp4_mma",
                        lambda *a, **k: asked.append(sorted(k.get("l2_prefetch") or {})) or forward(*a, **k))
    prompts = _prompts(1)
    prefetched = _decode_logits(narrow_ckpt, "mxfp4", graphs, prompts, steps=6, attention_precision="fp8",
                                prefetch_next=plan)
    assert sorted(plan) in asked, "no MoE launch was handed the next layer's weights"
    monkeypatch.setenv("PDSERVE_PDL", "0")
    monkeypatch.setattr(cm, "EVICT_FIRST", False)
    without = _decode_logits(narrow_ckpt, "mxfp4", graphs, prompts, steps=6, attention_precision="fp8")
    for step, (a, b) in enumerate(zip(prefetched, without)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"step {step}: the L2 prefetch changed the logits"
