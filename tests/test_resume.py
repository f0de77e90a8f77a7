"""Checkpoints and exact resumption, single process on CPU, with real kills of the training process.

The reference run is never interrupted; every interrupted-and-resumed run must reproduce its
metrics.jsonl exactly (all values but timings) for every step. Exact equality on purpose: the runs
share the machine, the thread count and the process layout, so the same operations round the same
way; a resume that reproduced only approximately would be restoring something wrong.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forkserver
import wandb_offline
from mlflow_store import sqlite_uri

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
ARGS = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=16",
        "--ppo_epochs=1", "--total_training_steps=6", "--save_freq=2", "--test_freq=3", "--save_total_limit=2",
        "--mlflow_log_model=false"]


def command(out, *extra):
    return [sys.executable, str(SCRIPT), f"--output_dir={out}", *ARGS, *extra]


def env_for(tmp):
    return dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp), PYTHONUNBUFFERED="1")


def run(tmp, out, *extra, env=None):
    return forkserver.run(command(out, *extra), cwd=tmp, env=env or env_for(tmp), capture_output=True, text=True,
                          timeout=600)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def comparable(rs):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rs]


def steps_logged(out):
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """The uninterrupted run's output_dir (checkpoints step_4 and step_6): read, or copied by
    tests that need a finished run's checkpoints to resume from."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = run(tmp, tmp / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "out"


@pytest.fixture(scope="module")
def reference(reference_dir):
    return records(reference_dir)


def start_and_kill(tmp, out, sig, after_lines, extra_delay):
    proc = forkserver.Popen(command(out), cwd=tmp, env=env_for(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 300
    while steps_logged(out) < after_lines and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(extra_delay)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    return proc.returncode, stdout, stderr


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_the_uninterrupted_run(tmp_path, reference):
    """Two SIGKILLs at random points, the second in the run that resumed after the first (so a
    resumed run is killed and resumed as well), then the same command to the end: every step
    logged once, and the uninterrupted run's numbers (a wrong resume at either point would show in
    the steps after it)."""
    rng = random.Random(os.getpid())
    first = rng.randint(2, 3)
    kill_points = [(first, rng.uniform(0, 1.5)), (rng.randint(first + 2, 6), rng.uniform(0, 1.5))]
    out = tmp_path / "out"
    for lines, delay in kill_points:   # the second start resumes from the first kill's newest checkpoint
        start_and_kill(tmp_path, out, signal.SIGKILL, lines, delay)
    proc = run(tmp_path, out)   # resume=auto picks the newest complete checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    got = records(out)
    assert [r["step"] for r in got] == list(range(7)), f"kill points {kill_points}: steps duplicated or lost"
    assert comparable(got) == comparable(reference), f"kill points {kill_points}: diverged"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, reference):
    out = tmp_path / "out"
    code, stdout, _ = start_and_kill(tmp_path, out, signal.SIGTERM, 2, 0.0)
    assert code == 0
    assert "checkpoint saved" in stdout
    stopped_at = records(out)[-1]["step"]
    assert (out / "checkpoints" / f"step_{stopped_at}" / "trainer_state.json").is_file()
    proc = run(tmp_path, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert comparable(records(out)) == comparable(reference)
    # save_total_limit=2 counts the checkpoints from before the resume too
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_4", "step_6"]


@pytest.mark.slow
def test_partial_and_corrupted_checkpoints_are_skipped_with_a_warning(tmp_path, reference_dir, reference):
    """The uninterrupted run's checkpoints (steps 4 and 6) with step 6 spoilt twice over: its state
    file never landed, and a save of it was interrupted mid-write. The run resumes from step 4 and
    logs the uninterrupted run's steps 5 and 6 again."""
    out = tmp_path / "out"
    shutil.copytree(reference_dir, out)
    ckpts = out / "checkpoints"
    shutil.copytree(ckpts / "step_6", ckpts / ".tmp_step_6")
    (ckpts / "step_6" / "trainer_state.json").unlink()
    proc = run(tmp_path, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping incomplete checkpoint {ckpts / 'step_6'}" in proc.stderr
    assert f"skipping partial checkpoint {ckpts / '.tmp_step_6'}" in proc.stderr
    assert f"resuming from {ckpts / 'step_4'}" in proc.stdout
    assert comparable(records(out)) == comparable(reference)
    assert sorted(p.name for p in ckpts.glob("*step_*")) == ["step_4", "step_6"]


@pytest.mark.slow
def test_checkpoint_from_a_different_config_is_refused_naming_the_keys(tmp_path, reference_dir):
    out = tmp_path / "out"
    shutil.copytree(reference_dir, out)
    proc = run(tmp_path, out, "--critic_lr=0.5", "--clip_ratio=0.3")   # actor_lr may change: a guard's advice
    assert proc.returncode != 0
    assert "critic_lr" in proc.stderr and "clip_ratio" in proc.stderr and "--resume=never" in proc.stderr
    assert [r["step"] for r in records(out)] == list(range(7))   # nothing lost


@pytest.mark.slow
def test_kl_spike_rolls_back_with_a_lower_lr_then_gives_up(tmp_path):
    """A tiny kl_rollback_threshold makes every step after the first a "KL spike"."""
    out = tmp_path / "out"
    proc = run(tmp_path, out, "--save_freq=1", "--kl_rollback_threshold=1e-12", "--max_rollbacks=2",
               "--rollback_lr_factor=0.5", "--total_training_steps=4", "--test_freq=-1")
    assert proc.returncode != 0
    assert proc.stderr.count("rolling back to") == 2
    assert "actor lr x0.5" in proc.stderr and "actor lr x0.25" in proc.stderr
    assert "giving up after max_rollbacks=2" in proc.stderr
    logged = records(out)
    # rolled-back steps were rewritten; the step that made it give up stays, with the rollback count
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert logged[2]["guard/rollbacks"] == 2
    assert (out / "checkpoints" / "step_1" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_nonfinite_reward_can_be_skipped_instead_of_stopping(tmp_path):
    (tmp_path / "nan_once.py").write_text(
        "CALLS = [0]\n"
        "def score(prompts, responses):\n"
        "    CALLS[0] += 1\n"
        "    return [float('nan') if CALLS[0] == 2 and i < 3 else 1.0 for i in range(len(prompts))]\n")
    out = tmp_path / "out"
    env = dict(env_for(tmp_path), PYTHONPATH=str(tmp_path))
    proc = forkserver.run(command(out, "--reward_fn=nan_once:score", "--skip_nonfinite_rewards=true",
                                  "--val_before_train=false", "--test_freq=-1", "--total_training_steps=3",
                                  "--save_freq=-1"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = records(out)
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert logged[1]["reward/nonfinite_frac"] == pytest.approx(3 / 32)
    assert logged[0]["reward/nonfinite_frac"] == 0.0
    assert all(abs(v) < float("inf") for r in logged for v in r.values())


class _Payload:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_checkpoint_file_carrying_a_pickled_callable_is_refused(tmp_path, reference_dir):
    """A checkpoint is data: a tampered file is refused with an error naming it, and what it
    carries never runs."""
    import torch
    out = tmp_path / "out"
    shutil.copytree(reference_dir, out)
    actor = out / "checkpoints" / "step_6" / "actor.pt"
    saved = torch.load(actor, weights_only=True)
    marker = tmp_path / "pwned"
    saved["extra"] = _Payload(str(marker))
    torch.save(saved, actor)
    proc = run(tmp_path, out, "--total_training_steps=7")
    assert proc.returncode != 0
    assert not marker.exists(), "unpickling the checkpoint ran its payload"
    assert "Traceback" not in proc.stderr
    assert str(actor) in proc.stderr and "refused" in proc.stderr


@pytest.mark.slow
def test_the_last_step_is_checkpointed_and_a_longer_run_is_said_in_the_log(tmp_path, reference):
    """save_freq=2 over 3 steps saves steps 2 and 3 (verl saves the last step too). Resuming with a
    larger total_training_steps under the constant schedule continues, and says so; with wandb=true
    (offline) the resumed run continues the same W&B run (the id in the checkpoint) from step 4."""
    out = tmp_path / "out"
    env = dict(env_for(tmp_path), **wandb_offline.env(tmp_path))
    proc = run(tmp_path, out, "--total_training_steps=3", "--wandb=true", env=env)   # save_freq=2
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    proc = run(tmp_path, out, "--total_training_steps=4", "--wandb=true", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "total_training_steps changed from 3 to 4" in proc.stdout
    assert [r["step"] for r in records(out)] == list(range(5))
    first, resumed = (wandb_offline.read(d) for d in wandb_offline.runs(out))   # offline: a folder per process
    saved = json.loads((out / "checkpoints" / "step_3" / "trainer_state.json").read_text())["wandb_run_id"]
    assert first["run"]["run_id"] == resumed["run"]["run_id"] == saved
    assert sorted(first["history"]) == [0, 1, 2, 3] and sorted(resumed["history"]) == [4]
    assert resumed["history"][4]["reward/score_mean"] == records(out)[4]["reward/score_mean"]
    assert first["exit_code"] == resumed["exit_code"] == 0


def test_a_different_length_under_the_cosine_schedule_is_refused_naming_the_key(tmp_path):
    """In process: the script passes its whole config to check_resumable, and a refusal from it
    stops the run with one line (test_checkpoint_from_a_different_config_is_refused_naming_the_keys,
    end to end)."""
    from dataclasses import asdict

    from plumbing.checkpoints import check_resumable
    from config import Config
    from errors import UserError
    saved = {"config": asdict(Config(lr_scheduler_type="cosine", total_training_steps=2))}
    with pytest.raises(UserError) as refused:
        check_resumable(asdict(Config(lr_scheduler_type="cosine", total_training_steps=4)), saved, tmp_path)
    assert "total_training_steps" in str(refused.value) and "cosine" in str(refused.value)
    saved = {"config": asdict(Config(total_training_steps=2))}   # the constant schedule: a longer run goes on
    notes = check_resumable(asdict(Config(total_training_steps=4)), saved, tmp_path)
    assert notes == ["total_training_steps changed from 2 to 4 since the checkpoint; using 4"]



def test_a_checkpoint_from_before_a_key_existed_resumes_at_that_keys_default(tmp_path):
    """A checkpoint written before a config key was added lacks it: the run that wrote it behaved as
    the default, so resuming with the default goes on and any other value is refused, naming the key."""
    from dataclasses import asdict

    from plumbing.checkpoints import check_resumable
    from config import Config
    from errors import UserError
    old = asdict(Config())
    del old["reward_placement"]
    assert check_resumable(asdict(Config()), {"config": old}, tmp_path) == []
    with pytest.raises(UserError) as refused:
        check_resumable(asdict(Config(reward_placement="uniform")), {"config": old}, tmp_path)
    assert "reward_placement: 'last' -> 'uniform'" in str(refused.value)

@pytest.mark.slow
def test_vllm_resume_samples_what_the_uninterrupted_run_samples(tmp_path, vllm_run):
    """The vLLM engine's per-request seed counter is in the checkpoint: resumed from its own step-2
    checkpoint, the uninterrupted 3-step run samples step 3 again with the same numbers (same
    machine, same layout: exactly). The uninterrupted run is test_e2e's shared vLLM run
    (conftest.vllm_run), a checkpoint every step."""
    from test_e2e import VLLM_RUN
    _, full, proc = vllm_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_3")   # as if killed before step 3's checkpoint
    proc = run(tmp_path, part, *VLLM_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {part / 'checkpoints' / 'step_2'}" in proc.stdout
    assert comparable(records(part)) == comparable(records(full))
