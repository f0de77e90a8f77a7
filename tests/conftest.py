"""The repository root on sys.path, so tests import train_ppo, kl, rollout, rewards and examples
however pytest is started; and how the suite spreads over pytest-xdist workers (pytest.ini runs
`-n auto`):

- workers: one per CPU, at most one per 4 GiB of available memory (a 2-process ZeRO-3 run with
  vLLM engines takes about 3 GiB), at most 4; `-n 0` runs everything in this process.
- tests that share a fixture built once per module or session (a training run several tests read)
  run on the same worker, so no run is made twice: they form one xdist group (`--dist loadgroup`).
- slow tests (with the tests that share their run) are handed out first, so the long ones do not
  trail at the end on one worker.
- each test process has a fork server (tests/forkserver.py): the Python processes tests start
  begin with the heavy libraries imported.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import pytest

import forkserver

GIB_PER_WORKER = 4
MAX_WORKERS = 4


def pytest_configure(config):
    """Each process that runs tests (an xdist worker, or pytest itself with -n 0) gets its fork
    server, so the Python processes its tests start begin with the libraries imported.

    A worker's share of the CPUs sizes torch's thread pool in it and in every process its tests
    start ($OMP_NUM_THREADS, read by torch at import; set before anything imports torch): each
    process would otherwise start one thread per CPU, so two workers ran twice as many busy
    threads as cores, and OpenMP's threads spin while they wait for each other (a 1-epoch test run
    took 63 s next to another 2-thread process, 12 s with one thread; 8 s on an idle machine).
    A 2-process launch's ranks get 1 thread each from torch's launcher anyway."""
    if hasattr(config, "workerinput"):
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = int(config.workerinput.get("workercount", 1))
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus // workers)))
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        forkserver.start()


def pytest_unconfigure(config):
    forkserver.stop()


def pytest_xdist_auto_num_workers(config):
    try:
        with open("/proc/meminfo") as f:
            available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        by_memory = available_kb // (GIB_PER_WORKER * 2**20)
    except (OSError, StopIteration, ValueError):
        by_memory = 1
    return max(1, min(os.cpu_count() or 1, by_memory, MAX_WORKERS))


def _shared_fixtures(item) -> list[str]:
    """The fixtures of this repository's tests that `item` uses and that live longer than one test."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    tests_dir = str(Path(__file__).parent)
    names = []
    for name, defs in info.name2fixturedefs.items():
        fixturedef = defs[-1]
        source = getattr(fixturedef.func, "__code__", None)
        if fixturedef.scope != "function" and source is not None and source.co_filename.startswith(tests_dir):
            names.append(f"{fixturedef.baseid}::{name}")
    return names


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    # union-find over tests joined by a shared long-lived fixture; each set of two or more is a group
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    fixtures = set()
    for item in items:
        for name in _shared_fixtures(item):
            fixtures.add(name)
            parent[find(name)] = find(item.nodeid)
    members: dict[str, int] = {}
    for item in items:
        members[find(item.nodeid)] = members.get(find(item.nodeid), 0) + 1
    label = {}   # a group is named by its first shared fixture: test_e2e.py::short_run
    for name in sorted(fixtures):
        label.setdefault(find(name), name.split("/")[-1])
    for item in items:
        root = find(item.nodeid)
        if members[root] > 1:
            item.add_marker(pytest.mark.xdist_group(label[root]))
    # slow first, order kept; a group goes with its slowest member, so the tests of one module that
    # share a module-scoped run stay together (split, pytest would tear the run down and make it again)
    slow = {find(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: find(item.nodeid) not in slow)


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory):
    """zero3_run(engine) -> (tmp, out, proc): the 2-process ZeRO-3 run (accelerate_configs/zero3.yaml,
    test_distributed.SHARED) with that rollout engine, launched once per session on first use and
    read by every test that checks such a run (test_distributed, test_sampling_truncation)."""
    runs = {}

    def get(engine: str):
        if engine not in runs:
            from test_distributed import ROOT, SHARED, SHARED_ENGINE, launch
            tmp = tmp_path_factory.mktemp(f"zero3_{engine}")
            proc = launch(tmp, ROOT / "accelerate_configs" / "zero3.yaml", f"--output_dir={tmp / 'out'}", *SHARED,
                          *SHARED_ENGINE[engine])
            runs[engine] = (tmp, tmp / "out", proc)
        return runs[engine]
    return get


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory):
    """(tmp, out, proc): the single-process vLLM run of test_e2e.VLLM_RUN (3 steps, a checkpoint
    every step), read by test_e2e's sync test and, as the uninterrupted run, by test_resume's
    vLLM resume test."""
    from test_e2e import VLLM_RUN, run
    tmp = tmp_path_factory.mktemp("vllm")
    return tmp, tmp / "out", run(tmp, f"--output_dir={tmp / 'out'}", *VLLM_RUN)
