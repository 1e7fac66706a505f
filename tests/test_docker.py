"""Static checks of docker/Dockerfile and docker/Dockerfile.cpu (no Docker engine needed).

They catch what breaks an image build or a pod start: a base image of the wrong kind, torch
resolved from PyPI instead of the intended index, a package folder missing from the image, a
root user, an entrypoint that is not the `pdserve` CLI.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comment lines dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def arg_defaults(steps) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def packages() -> list[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return sorted(pyproject["tool"]["setuptools"]["package-dir"].values())


@pytest.fixture(params=["Dockerfile", "Dockerfile.cpu"])
def dockerfile(request):
    return DOCKER / request.param


def stages(steps) -> dict[str, list[tuple[str, str]]]:
    """Steps by stage name (`FROM image AS name`), in order."""
    out: dict[str, list] = {}
    current = None
    for k, a in steps:
        if k == "FROM":
            parts = a.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"unnamed stage: FROM {a}"
            current = out.setdefault(parts[2], [])
        current is not None and current.append((k, a))
    return out


def test_two_stages_and_a_final_stage_without_build_tools(dockerfile):
    steps = instructions(dockerfile)
    known = {"ARG", "FROM", "LABEL", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE",
             "ENTRYPOINT", "CMD"}
    assert {k for k, _ in steps} <= known
    before_from = [k for k, _ in steps[: [k for k, _ in steps].index("FROM")]]
    assert set(before_from) <= {"ARG"}, "only ARGs may precede FROM"
    by_stage = stages(steps)
    assert list(by_stage) == ["build", "runtime"]
    final = by_stage["runtime"]
    assert not _pip_installs(final, {}), "the final stage installs nothing with pip"
    copies = [a for k, a in final if k == "COPY"]
    assert copies == ["--from=build /opt/pdserve /opt/pdserve"]  # the virtualenv and vocabulary


def test_entrypoint_is_the_cli_under_an_init_and_user_is_not_root(dockerfile):
    steps = instructions(dockerfile)
    entry = [a for k, a in steps if k == "ENTRYPOINT"]
    # exec form; tini is PID 1: it forwards SIGTERM to pdserve and reaps the worker's ranks
    assert len(entry) == 1 and json.loads(entry[0]) == ["/usr/bin/tini", "--", "pdserve"]
    final_runs = " ".join(a for k, a in stages(steps)["runtime"] if k == "RUN")
    assert re.search(r"apt-get install [^&]*\btini\b", final_runs), "tini is installed in the final stage"
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1].split(":")[0] == "1000"  # numeric: runAsNonRoot can verify it
    last_user = max(i for i, (k, _) in enumerate(steps) if k == "USER")
    assert all(k != "RUN" for k, _ in steps[last_user:]), "nothing runs as root after USER"


def test_every_package_of_the_distribution_is_copied(dockerfile):
    steps = instructions(dockerfile)
    sources = set()
    for k, a in steps:
        if k == "COPY" and not a.startswith("--from="):
            *src, _dest = shlex.split(a)
            sources |= {s.rstrip("/") for s in src if not s.startswith("--")}
    missing = set(packages()) - sources
    assert not missing, f"{dockerfile.name} does not COPY {sorted(missing)}"
    assert {"pyproject.toml", "docker/constraints.txt"} <= sources
    for source in sorted(sources):
        assert (REPO / source).exists(), (
            f"{dockerfile.name} copies {source}, which the repository lacks: the build would fail"
        )


def constraints() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name] = version
    return pins


def test_the_kv_transfer_stack_is_pinned_inside_pyproject_ranges(dockerfile):
    from importlib.metadata import version

    from packaging.requirements import Requirement

    pins = constraints()
    assert "nixl" in pins  # nixl's wheels bundle UCX: pinning nixl pins UCX
    deps = {Requirement(d).name: Requirement(d) for d in
            tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert deps["nixl"].specifier.contains(pins["nixl"])
    assert version("nixl") == pins["nixl"], "the tests run on another nixl than the images ship"
    from pdserve.kvtransfer.ucx_info import ucx_version

    (stated,) = set(re.findall(r"UCX (\d+\.\d+\.\d+)", (DOCKER / "constraints.txt").read_text()))
    assert ucx_version() == stated  # what the workers log at start
    steps = instructions(dockerfile)
    package = [argv for _, argv in _pip_installs(steps, arg_defaults(steps)) if "." in argv or ".[gpu]" in argv]
    assert len(package) == 1 and _option(package[0], "-c") == "docker/constraints.txt"


def _pip_installs(steps, args):
    """(index of step, argv) for every `pip install` command in RUN steps."""
    found = []
    for i, (k, a) in enumerate(steps):
        if k != "RUN":
            continue
        for command in expand(a, args).split("&&"):
            argv = shlex.split(command)
            if argv[:2] == ["pip", "install"]:
                found.append((i, argv))
    return found


def _option(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_image_installs_cpu_torch_before_the_package():
    steps = instructions(DOCKER / "Dockerfile.cpu")
    args = arg_defaults(steps)
    bases = [expand(a.split()[0], args) for k, a in steps if k == "FROM"]
    for base in bases:
        assert re.fullmatch(r"python:3\.1[0-9]-slim(-\w+)?", base), base
    assert len(set(bases)) == 1  # the virtualenv's python is the final stage's python
    installs = _pip_installs(steps, args)
    torch = [(i, argv) for i, argv in installs if "torch==2.13.0" in argv]
    package = [(i, argv) for i, argv in installs if "." in argv]
    assert len(torch) == 1 and len(package) == 1, installs
    assert _option(torch[0][1], "--index-url") == "https://download.pytorch.org/whl/cpu"
    assert torch[0][0] < package[0][0], "CPU torch must be installed before pdserve"
    assert _option(package[0][1], "--index-url") is None  # the rest from PyPI as usual


def test_gpu_image_is_cuda_with_gpu_extra():
    steps = instructions(DOCKER / "Dockerfile")
    args = arg_defaults(steps)
    build, runtime = [expand(a.split()[0], args) for k, a in steps if k == "FROM"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu(\d+\.\d+)", build)
    assert match, build
    assert runtime == build.replace("-devel-", "-runtime-"), runtime  # same CUDA, same Python
    final_runs = " ".join(a for k, a in stages(steps)["runtime"] if k == "RUN")
    for package in ("cuda-nvcc", "cuda-cudart-dev", "cuda-cccl", "gcc", "python3-dev"):  # run-time JIT
        assert package in final_runs, package
    installs = _pip_installs(steps, args)
    torch = [(i, argv) for i, argv in installs if any(a.startswith("torch==") for a in argv)]
    package = [(i, argv) for i, argv in installs if ".[gpu]" in argv]
    assert len(torch) == 1 and len(package) == 1, installs
    assert torch[0][0] < package[0][0]
    # torch from the index of the base image's CUDA version: cu130 for CUDA 13.0
    index = _option(torch[0][1], "--index-url")
    assert index == f"https://download.pytorch.org/whl/cu{match.group(1)}{match.group(2)}", index
