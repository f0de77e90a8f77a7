"""The repository root on sys.path, so tests import train_ppo, kl, rollout, rewards and examples
however pytest is started."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import pytest


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
