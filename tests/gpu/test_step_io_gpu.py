"""kernels/step_io.py on the GPU: pinned host memory seen through `mapped` is the same memory for
kernels that read it (stage_step's staged bytes and fed ids) and for kernels that write it (the
pipelined argmax), on fresh random buffers; and a captured decode step fed that way replays like
the eager step."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is


@pytest.mark.parametrize("nbytes,n_fed", [(16, 1), (4100, 0), (3 * 4096 + 64, 9), (64 * 1024, 64)])
def test_stage_step_reads_pinned_bytes_and_fed_ids(seed, nbytes, n_fed):
    from pdserve.kernels.step_io import mapped, stage_step

    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).pin_memory()
    fed_host = torch.randint(0, 201088, (n_fed,), generator=g, dtype=torch.int64).pin_memory()
    dst = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    stage_step(mapped(host), dst, mapped(fed_host) if n_fed else None)
    want = host.clone()
    want[: 8 * n_fed] = fed_host.view(torch.uint8)
    assert torch.equal(dst.cpu(), want)
    # fed from a device tensor too (the gathered ids of a reordered batch)
    dst.fill_(0xA5)
    stage_step(mapped(host), dst, fed_host.cuda() if n_fed else None)
    assert torch.equal(dst.cpu(), want)


def test_argmax_writes_pinned_ids_the_host_reads_after_the_event(seed):
    from pdserve.kernels.step_io import mapped

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(5, 201088, generator=g, device="cuda")
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index, as torch's argmax
    host = torch.full((5,), -1, dtype=torch.long).pin_memory()
    view = mapped(host)
    assert view.is_cuda and view.data_ptr() == host.data_ptr()
    torch.argmax(logits, dim=-1, out=view)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert host.tolist() == torch.argmax(logits, dim=-1).cpu().tolist() and host[2] == 7


def test_mapped_refuses_pageable_memory():
    from pdserve.kernels.step_io import mapped

    with pytest.raises(ValueError, match="pinned"):
        mapped(torch.zeros(3, dtype=torch.long))
