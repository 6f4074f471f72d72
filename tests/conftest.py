"""Shared pytest fixtures: the golden fixture set (COSYSTREAM_FIXTURES) and its materialised model dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter in tests without a GPU; Triton reads this when it is first
    # imported, which any test may cause, so it is set before every test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
KERNEL_TESTS = REPO / "tests" / "kernels"
SHIPPED = REPO / "tests" / "fixtures"  # the golden sets shipped with the repository (tests/fixtures/README.md)
DEFAULT_SET = SHIPPED / "cosyvoice2-tiny"
DEFAULT_SET_CV3 = SHIPPED / "cosyvoice3-tiny"
NOISE_PREFIX_FILE = "cfm_rand_noise_prefix.safetensors"
# Under pytest-xdist (`-n 2 --dist loadgroup --no-loadscope-reorder`, as .ci/run runs the suite) every worker
# collects the same items and the controller hands them out one group at a time.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def fixture_set_dir() -> Path:
    """The CosyVoice2 set the tests run on: $COSYSTREAM_FIXTURES, else the shipped one."""
    return Path(os.environ.get("COSYSTREAM_FIXTURES", str(DEFAULT_SET))).resolve()


def fixture_set_dir_cv3() -> Path:
    """The CosyVoice3 set: $COSYSTREAM_FIXTURES_CV3, else the shipped one."""
    return Path(os.environ.get("COSYSTREAM_FIXTURES_CV3", str(DEFAULT_SET_CV3))).resolve()


def _materialize_script(set_dir: Path) -> Path:
    for candidate in (set_dir.parent / "materialize.py", SHIPPED / "materialize.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"materialize.py not found beside {set_dir} or in {SHIPPED}")


def noise_prefix_file(set_dir: Path) -> Path:
    """The set's stored CFM noise prefix, else the longest shipped one.

    The fixtures README lets a set store no prefix: the table is the same seed-0 draw for every model, and
    the shipped sets store exact prefixes of it (tests/models/test_flow.py checks the recipe against them).
    """
    own = set_dir / NOISE_PREFIX_FILE
    if own.is_file():
        return own
    shipped = list(SHIPPED.glob(f"*/{NOISE_PREFIX_FILE}"))
    if not shipped:
        raise FileNotFoundError(f"{NOISE_PREFIX_FILE}: neither in {set_dir} nor in a set under {SHIPPED}")
    return max(shipped, key=lambda p: load_file(str(p))["rand_noise_prefix"].shape[-1])


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a GPU the kernel tests that take a `device` run Triton's CPU interpreter, up to a minute per
    test: they are `slow` there (on a GPU they take seconds and stay in the default run). Under xdist the
    items are grouped and ordered for the workers."""
    if not torch.cuda.is_available():
        for item in items:
            if "device" in getattr(item, "fixturenames", ()) and _is_kernel_test(item):
                item.add_marker(pytest.mark.slow)
    if XDIST_WORKER is not None:
        items[:] = _grouped_for_workers(items)


def _is_kernel_test(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).is_relative_to(KERNEL_TESTS)


def _worker_group(item: pytest.Item) -> str:
    """A test module stays on one worker, so its module-scoped fixtures (an engine, a server) are built once;
    the kernel tests (session fixtures only, each one long in the interpreter) spread out one by one; every
    Ray test shares one worker, so only one local Ray cluster runs at a time."""
    if item.get_closest_marker("ray") is not None:
        return "ray"
    return item.nodeid if _is_kernel_test(item) else item.nodeid.split("::", 1)[0]


def _grouped_for_workers(items: list[pytest.Item]) -> list[pytest.Item]:
    """Items tagged with their worker group, the groups holding a slow test first (collection order
    otherwise): the long ones start early and the many short ones fill both workers up to the end."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        name = _worker_group(item)
        item.add_marker(pytest.mark.xdist_group(name))
        groups.setdefault(name, []).append(item)
    ordered = sorted(groups.values(), key=lambda group: not any(i.get_closest_marker("slow") for i in group))
    return [item for group in ordered for item in group]


def _share_cores_among_workers() -> None:
    """Each xdist worker gets its share of the cores for torch's threads (and the processes it starts):
    two workers with a thread per core each would fight over the same cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "OMP_NUM_THREADS" in os.environ or workers <= 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


if XDIST_WORKER is not None:
    _share_cores_among_workers()


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The fixture set directory (read-only); fails loudly when it is absent."""
    d = fixture_set_dir()
    if not (d / "weights.json").is_file():
        pytest.fail(f"fixture set not found at {d} (COSYSTREAM_FIXTURES names another set; the shipped sets "
                    f"are in {SHIPPED})")
    return d


@pytest.fixture(scope="session")
def materialized(fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the fixture set with its weight files written (once per session)."""
    out = tmp_path_factory.mktemp("fixture_set")
    subprocess.run([sys.executable, str(_materialize_script(fixture_dir)), str(fixture_dir), str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def model_dir(materialized: Path) -> Path:
    return materialized / "model"


@pytest.fixture(scope="session")
def cv3_dir() -> Path:
    """The CosyVoice3 fixture set directory (read-only); fails loudly when it is absent."""
    d = fixture_set_dir_cv3()
    if not (d / "weights.json").is_file():
        pytest.fail(f"CosyVoice3 fixture set not found at {d} (set COSYSTREAM_FIXTURES_CV3)")
    return d


@pytest.fixture(scope="session")
def cv3_model_dir(cv3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CosyVoice3 set's model directory with its weights materialised (once per session)."""
    out = tmp_path_factory.mktemp("cv3_set")
    subprocess.run([sys.executable, str(_materialize_script(cv3_dir)), str(cv3_dir), str(out)],
                   check=True, capture_output=True)
    return out / "model"


@pytest.fixture(scope="session")
def manifest(fixture_dir: Path) -> dict:
    return json.loads((fixture_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def load_fixture(fixture_dir: Path):
    """load_fixture("flow") -> dict of tensors from flow.safetensors."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_file(str(fixture_dir / f"{name}.safetensors"))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def checkpoint(model_dir: Path):
    from cosystream.checkpoint import load_checkpoint

    return load_checkpoint(model_dir)


@pytest.fixture(scope="session")
def cfm_noise(fixture_dir: Path) -> torch.Tensor:
    """An exact stored prefix of the official CFM noise table (spec/flow.md §4): the set's, else a shipped one."""
    return load_file(str(noise_prefix_file(fixture_dir)))["rand_noise_prefix"]
