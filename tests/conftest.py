"""Shared fixtures: small random checkpoints in the published layout, built once per session."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

# The project is tested as installed (pdserve.*): the checkout's folders are not top-level modules.
# `python -m pytest` puts the working directory first on the path, where the checkout's `kernels/`
# would shadow the `kernels` distribution (transformers imports it when it is installed).
CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != CHECKOUT]

if not torch.cuda.is_available():  # NIXL refuses a UCX_TLS without cuda transports on GPU hosts
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with `pytest -m gpu` on the device)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not a keyword: a folder named gpu matches those
            item.add_marker(skip)


SEED_ENV = "PDSERVE_TEST_SEED"


@pytest.fixture(autouse=True)
def random_seed(request) -> int:
    """Fresh random inputs for each test, replayable: torch's generators and the `rng` fixture draw
    from one seed per test, a failing test's report names it, and PDSERVE_TEST_SEED=<seed> makes
    the same inputs again (tests that seed torch themselves keep their own seed)."""
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 32))
    if "module_seed" in request.fixturenames:  # the inputs that matter are the module's: report its seed
        request.node.user_properties.append((SEED_ENV, request.getfixturevalue("module_seed")))
    request.node.user_properties.append((SEED_ENV, seed))
    torch.manual_seed(seed)
    return seed


@pytest.fixture(scope="module")
def module_seed() -> int:
    """The seed of a module's shared inputs (a module-scoped fixture that runs kernels once for many
    tests). Such a fixture is set up before any test's `random_seed`, so a draw from torch's generator
    there would depend on the tests that ran before; this draws as `random_seed` does, is named in a
    failing test's report, and PDSERVE_TEST_SEED=<seed> replays it."""
    return int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 31))


@pytest.fixture
def rng(random_seed) -> random.Random:
    return random.Random(random_seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [v for k, v in item.user_properties if k == SEED_ENV]
    if report.failed and seeds:
        report.sections.append(("random inputs", f"replay with {SEED_ENV}={seeds[0]}"))
    return report


@pytest.fixture(scope="session")
def tiny_cfg():
    from pdserve.engine.config import preset

    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_mxfp4(tmp_path_factory, tiny_cfg):
    from pdserve.engine.checkpoint_writer import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-mxfp4", tiny_cfg, seed=0,
                                  experts="mxfp4", max_shard_bytes=48 << 20)


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory, tiny_cfg):
    from pdserve.engine.checkpoint_writer import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bf16", tiny_cfg, seed=0,
                                  experts="bf16", max_shard_bytes=48 << 20)


@pytest.fixture(scope="session")
def tiny_runner(tiny_mxfp4):
    from pdserve.engine.model_runner import ModelRunner

    return ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=512)
