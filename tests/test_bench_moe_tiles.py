"""The Marlin-shaped folded gate/up probe (bench/moe_tiles.py) builds for sm_90 with NVRTC at its default
shapes, without spills, and its ring fits one SM's shared memory."""

import re

import pytest

from nvrtc_offline import compile_cuda


@pytest.mark.parametrize("kt,stages", [(1, 4), (1, 6), (2, 4), (2, 6), (4, 3)])
def test_probe_builds_without_spills(kt, stages):
    from pdserve.bench import moe_tiles

    _, log = compile_cuda(moe_tiles.SOURCE, moe_tiles.compile_options(kt, stages))
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    assert stages * moe_tiles.stage_bytes(kt) <= 227 * 1024
