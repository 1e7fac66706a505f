"""bench/launch_ab.py's noise controls, without a GPU: the first setting repeated under its own
names, and the spread of its captures' medians."""

from __future__ import annotations

import pytest

from pdserve.bench import launch_ab


def test_controls_repeat_the_first_setting_under_their_own_names():
    settings = {"default": ("env", {"a": 1}, {}), "other": ("env", {}, {})}
    with_two, controls = launch_ab.with_controls(settings, 2)
    assert list(with_two) == ["default", "other", "default (control 1)", "default (control 2)"]
    assert with_two["default (control 2)"] is settings["default"]
    assert controls == {"default (control 1)": "default", "default (control 2)": "default"}
    assert launch_ab.with_controls(settings, 0) == (settings, {})


def test_control_spread_is_the_range_of_the_first_settings_captures():
    _, controls = launch_ab.with_controls({"default": None, "other": None}, 2)
    medians = {"default": 100.0, "other": 90.0, "default (control 1)": 101.5, "default (control 2)": 99.0}
    assert launch_ab.control_spread(medians, controls) == pytest.approx((0.99, 1.015))
    assert launch_ab.control_spread(medians, {}) is None
