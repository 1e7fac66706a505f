"""bench/ncu_source.py: the summary of an Nsight Compute source-page export (CPU only; the rows below
are in the layout `ncu --import R --page source --csv --print-source sass` writes: a "Kernel Name" row,
a header, an instruction a row, for each kernel)."""

from __future__ import annotations

import csv
import io

import pytest

from pdserve.bench import ncu_source

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "Thread Instructions Executed", "stall_barrier", "stall_long_sb",
          "stall_wait", "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)", "stall_wait (Not Issued)"]


def _export(kernels: dict[str, list[list[str]]]) -> list[list[str]]:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    for name, rows in kernels.items():
        w.writerow(["Kernel Name", name, ""])
        w.writerow(HEADER)
        w.writerows(rows)
    return list(csv.reader(io.StringIO(out.getvalue())))


ATTENTION = [
    ["0x7f00", "      LDC R1, c[0x0][0x28]", "3", "3", "3", "512", "16384", "0", "0", "3", "0", "0", "3"],
    ["0x7f10", "@!P4 LDGSTS.E.BYPASS.128 [R49], desc[UR10][R18.64], !P4", "10", "9", "10", "2,048", "65536",
     "0", "8", "2", "0", "8", "1"],
    ["0x7f20", "      UCGABAR_WAIT", "20", "20", "20", "512", "16384", "20", "0", "0", "20", "0", "0"],
    ["0x7f30", "      IMAD.MOV.U32 R56, RZ, RZ, R36", "7", "7", "7", "2048", "65536", "0", "7", "0", "0", "7", "0"],
]
ROUTER = [["0x8000", "      HMMA.16816.F32 R4, R8, R12, R4", "1", "1", "1", "64", "2048", "0", "0", "1", "0", "0", "1"]]


def test_parses_each_kernel_with_its_instructions_opcodes_and_issued_stalls():
    kernels = ncu_source.parse(_export({"decode_attention": ATTENTION, "route": ROUTER}))
    assert [k.name for k in kernels] == ["decode_attention", "route"]
    attention = kernels[0]
    assert [i.opcode for i in attention.instructions] == ["LDC", "LDGSTS", "UCGABAR_WAIT", "IMAD"]
    assert attention.instructions[1].executed == 2048  # thousands separators read
    # the "(Not Issued)" columns are a subset of the samples, not more of them
    assert attention.stall_totals() == {"long_sb": 15, "barrier": 20, "wait": 5}
    assert sum(attention.stall_totals().values()) == sum(i.samples for i in attention.instructions)
    assert attention.opcode_totals() == {"LDC": 512, "LDGSTS": 2048, "UCGABAR_WAIT": 512, "IMAD": 2048}
    assert kernels[1].stall_totals() == {"wait": 1}


def test_report_orders_instructions_by_samples_and_scales_per_warp():
    kernel = ncu_source.parse(_export({"decode_attention": ATTENTION}))[0]
    text = ncu_source.report(kernel, warps=512, top=2).splitlines()
    assert text[0] == "decode_attention: 40 stall samples, 5120 warp instructions executed, 10 a warp over 512 warps"
    assert text[1] == "stalls: barrier 50%, long_sb 38%, wait 12%"
    assert text[2].startswith("opcodes a warp: LDGSTS 4, IMAD 4, LDC 1")
    assert "UCGABAR_WAIT" in text[4] and "barrier 20" in text[4]
    assert "LDGSTS" in text[5] and "long_sb 8, wait 2" in text[5]
    assert len(text) == 6  # the header line and the top 2


def test_an_export_without_the_sampling_columns_is_refused():
    rows = _export({"k": []})
    rows[1] = ["Address", "Source", "Instructions Executed"]
    with pytest.raises(ValueError, match="WarpStateStats"):
        ncu_source.parse(rows)
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_source.parse([HEADER])
