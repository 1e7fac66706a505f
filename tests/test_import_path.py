"""The project imports as one name, `pdserve`: the checkout's folders (kernels/, router/, proto/, ...)
never become top-level modules, where they would shadow other distributions of the same name."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def test_importing_the_benchmarks_leaves_the_checkout_off_the_path():
    """The bench modules put the checkout on sys.path only when run as scripts: imported as
    pdserve.bench.*, its `kernels/` folder must not become the top-level `kernels` (a distribution
    transformers imports when installed; a CI run failed in test_matches_transformers so)."""
    import pdserve.bench

    for m in pkgutil.iter_modules(pdserve.bench.__path__):
        importlib.import_module(f"pdserve.bench.{m.name}")
    assert all(Path(p or ".").resolve() != CHECKOUT for p in sys.path)
    for name in ("kernels", "router", "proto", "engine"):
        spec = importlib.util.find_spec(name)
        where = [spec.origin, *(spec.submodule_search_locations or [])] if spec is not None else []
        assert not any(w and Path(w).resolve().is_relative_to(CHECKOUT / name) for w in where), spec
