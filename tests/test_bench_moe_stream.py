"""bench/moe_stream.py without a GPU: its kernel's tiles agree with the module's constants (its
sm_90 build: tests/test_pdl_early_reads_sm90.py)."""

from __future__ import annotations

import re

from pdserve.bench import moe_stream


def test_kernel_tiles_match_the_module():
    src = moe_stream.SOURCE
    macro = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define (KG|TILES_GU|TILES_DN) (\d+)", src)}
    assert macro == {"KG": moe_stream.KG, "TILES_GU": moe_stream.TILES_GU, "TILES_DN": moe_stream.TILES_DN}
    assert moe_stream.TILES_GU * 16 == moe_stream.ROWS_GU and moe_stream.TILES_DN * 16 == moe_stream.ROWS_DN
