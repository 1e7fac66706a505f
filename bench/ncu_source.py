"""Where a kernel's warps wait, instruction by instruction: a summary of Nsight Compute's source page.

    ncu --section WarpStateStats --section SourceCounters -k regex:NAME --launch-skip S --launch-count 1 \\
        -o REPORT python3 ...
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > REPORT.csv
    python -m pdserve.bench.ncu_source REPORT.csv [--warps N] [--top 25]

For each kernel in the export: the stall samples summed by reason, the executed warp instructions by
opcode (per warp where --warps gives the launch's warps, CTAs x warps a CTA), and the instructions
with the most stall samples with their two largest reasons. The aggregate stall ratios of the
details page cannot say which instruction a warp waits on; this can (the profile-first step of
docs/performance.md's rounds).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    address: str
    source: str
    samples: int
    executed: int
    stalls: dict[str, int]

    @property
    def opcode(self) -> str:
        """The opcode without its predicate and modifiers: `@!P1 LDGSTS.E.BYPASS.128 ...` -> LDGSTS."""
        words = self.source.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        return op.split(".")[0]


@dataclass
class Kernel:
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def stall_totals(self) -> Counter:
        total = Counter()
        for ins in self.instructions:
            total.update(ins.stalls)
        return total

    def opcode_totals(self) -> Counter:
        total = Counter()
        for ins in self.instructions:
            total[ins.opcode] += ins.executed
        return total


def _int(cell: str) -> int:
    return int(cell.replace(",", "")) if cell.strip() not in ("", "-") else 0


def parse(rows: list[list[str]]) -> list[Kernel]:
    """The kernels of a `--page source --csv --print-source sass` export: a "Kernel Name" row, a header
    row, then one row an instruction, for each kernel profiled."""
    kernels: list[Kernel] = []
    header: dict[str, int] | None = None
    for row in rows:
        if not row or not any(cell.strip() for cell in row):
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1]))
            header = None
        elif header is None:
            if not kernels:
                raise ValueError("not an Nsight Compute source export: no 'Kernel Name' row first")
            header = {name: i for i, name in enumerate(row)}
            missing = {"Address", "Source", SAMPLES, EXECUTED} - header.keys()
            if missing:
                raise ValueError(f"the export lacks {sorted(missing)}: profile with --section WarpStateStats "
                                 "--section SourceCounters and export with --print-source sass")
            reasons = [n for n in header if n.startswith("stall_") and "(Not Issued)" not in n]
        else:
            stalls = {r[len("stall_"):]: _int(row[header[r]]) for r in reasons if _int(row[header[r]])}
            kernels[-1].instructions.append(Instruction(row[header["Address"]], row[header["Source"]].strip(),
                                                        _int(row[header[SAMPLES]]), _int(row[header[EXECUTED]]),
                                                        stalls))
    return kernels


def report(kernel: Kernel, warps: int | None, top: int) -> str:
    samples = sum(i.samples for i in kernel.instructions)
    executed = sum(i.executed for i in kernel.instructions)
    per = f", {executed / warps:.0f} a warp over {warps} warps" if warps else ""
    lines = [f"{kernel.name}: {samples} stall samples, {executed} warp instructions executed{per}"]
    stalls = kernel.stall_totals()
    lines.append("stalls: " + ", ".join(f"{r} {n / max(samples, 1):.0%}" for r, n in stalls.most_common() if n))
    ops = kernel.opcode_totals()
    scale = warps or 1
    lines.append("opcodes" + (" a warp" if warps else "") + ": "
                 + ", ".join(f"{op} {n / scale:.0f}" for op, n in ops.most_common(16)))
    lines.append(f"{'samples':>8} {'executed':>9}  address  instruction")
    for ins in sorted(kernel.instructions, key=lambda i: -i.samples)[:top]:
        why = ", ".join(f"{r} {n}" for r, n in Counter(ins.stalls).most_common(2))
        lines.append(f"{ins.samples:8d} {ins.executed:9d}  {ins.address[-5:]:>7}  {ins.source[:60]:60s} {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--warps", type=int, default=None, help="warps of the launch (CTAs x warps a CTA)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    with a.csv.open(newline="") as f:
        kernels = parse(list(csv.reader(f)))
    print("\n\n".join(report(k, a.warps, a.top) for k in kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
