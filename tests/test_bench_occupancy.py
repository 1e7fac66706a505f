"""bench/occupancy.py's arithmetic, without a GPU: whether a full layer's attention CTA fits on an SM beside as
many QKV CTAs as the SM holds, with the fifty-fourth round's measured builds (docs/performance.md)."""

from pdserve.bench.occupancy import cta_registers, room_beside

SM = 233472  # an H100 / H200 SM's shared memory (228 KB, the driver's 1 KB a CTA included)


def _build(shared: int, registers: int, per_sm: int, threads: int = 128) -> dict:
    return {"shared": shared, "registers": registers, "cta_registers": cta_registers(registers, threads),
            "per_sm": per_sm}


def test_registers_go_to_warps_in_units_of_256():
    assert cta_registers(77, 128) == 80 * 128 and cta_registers(136, 128) == 136 * 128
    assert cta_registers(105, 128) == 112 * 128


def test_no_attention_cta_fits_beside_six_qkv_ctas_of_eight_rows_but_one_fits_beside_three_of_sixteen():
    one_block = _build(43344, 135, 3)
    qkv8 = _build(28816 + 5648, 77, 6)
    qkv16 = _build(51856 + 6688, 105, 3)
    smem, regs = room_beside(qkv8, one_block, SM)
    assert smem < 0 and regs < 0
    smem, regs = room_beside(qkv16, one_block, SM)
    assert smem >= 0 and regs >= 0
    assert room_beside(qkv16, _build(76112, 135, 3), SM)[0] < 0  # two blocks of keys do not
