"""kernels/nvrtc.py's `PDSERVE_SMEM_CARVEOUT` spec: one percent for every kernel, or per kernel name."""

from __future__ import annotations

import pytest

from pdserve.kernels.nvrtc import _carveouts


def test_empty_spec_leaves_the_driver_its_choice():
    assert _carveouts("") == {}


def test_one_percent_is_every_kernel_s():
    assert _carveouts("58") == {"*": 58}


def test_per_kernel_spec():
    assert _carveouts("mx_down=58, _add_rms_norm_kernel=100,*=0") == {
        "mx_down": 58, "_add_rms_norm_kernel": 100, "*": 0}


@pytest.mark.parametrize("spec", ["mx_down", "mx_down=x", "101", "mx_down=-1"])
def test_bad_spec_is_refused(spec):
    with pytest.raises(ValueError):
        _carveouts(spec)
