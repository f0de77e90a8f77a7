"""The asynchronous modes (rollout_mode: one_step_off | async): real runs of train_ppo.py on the demo
model with real rollout processes (spawned, the hf engine, weights over a gloo group).

What is compared: every metric both runs log except timings (time/*, perf/*) and the rollout
side's own clock (rollout/gen_s, rollout/wait_train_s), step by step, within fp32 tolerance: the
runs share the machine and thread count, but the samples come from another process's copy of the
actor, so only the arithmetic may differ, never the samples.
"""
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import forkserver
from mlflow_store import sqlite_uri

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
ARGS = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=16",
        "--ppo_epochs=1", "--test_freq=-1", "--val_before_train=false", "--mlflow_log_model=false"]
ASYNC_ONLY = ("rollout/staleness_mean", "rollout/staleness_max", "rollout/gen_s", "rollout/wait_train_s",
              "time/wait_rollout_s")
CLOCK = ("time/", "perf/", "rollout/gen_s", "rollout/wait_train_s")


def command(out, *extra):
    return [sys.executable, str(SCRIPT), f"--output_dir={out}", *ARGS, *extra]


def env_for(tmp):
    return dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp), PYTHONUNBUFFERED="1")


def train(tmp, name, *extra, steps=3, said=""):
    """The run's metrics.jsonl records; said: a line its stdout must hold."""
    out = tmp / name
    proc = forkserver.run(command(out, f"--total_training_steps={steps}", *extra), cwd=tmp, env=env_for(tmp),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert said in proc.stdout, proc.stdout[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(expected, got):
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got):
        keys = {k for k in want if not k.startswith(CLOCK)}
        assert keys == {k for k in have if not k.startswith(CLOCK) and (k in want or k not in ASYNC_ONLY)}, want["step"]
        for k in keys:
            assert have[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (want["step"], k)


@pytest.mark.slow
@pytest.mark.parametrize("extra,steps", [((), 3), (("--lora_rank=4",), 2)], ids=["full", "lora"])
def test_async_with_max_staleness_0_is_the_colocated_run(tmp_path, extra, steps):
    """lora: the rollout side gets the adapters merged into the base weights, as a colocated vLLM does."""
    colocated = train(tmp_path, "colocated", *extra, steps=steps)
    asynchronous = train(tmp_path, "async", *extra, "--rollout_mode=async", "--max_staleness=0", steps=steps)
    assert_same_run(colocated, asynchronous)
    assert [r["rollout/staleness_max"] for r in asynchronous] == [0.0] * steps
    assert abs(colocated[-1]["kl/mean"]) > 1e-4   # the policy moved: the batches after the first test the weight sync


@pytest.mark.slow
def test_one_step_off_is_the_one_step_late_schedule_run_sequentially(tmp_path):
    """rollout_processes=0 runs the same schedule (step t+1's batch from the weights after step t-1)
    in the training process, one batch after the other; 1 and 2 rollout processes overlap it and
    must log the same numbers (the draws are keyed to the prompt and sample, not the process)."""
    extra = ("--rollout_mode=one_step_off", "--rollout_is=token")
    sequential = train(tmp_path, "sequential", *extra, "--rollout_processes=0")
    assert [r["rollout/staleness_mean"] for r in sequential] == [0.0, 1.0, 1.0]
    assert_same_run(sequential, train(tmp_path, "one", *extra, "--rollout_processes=1"))
    assert_same_run(sequential, train(tmp_path, "two", *extra, "--rollout_processes=2"))
    colocated = train(tmp_path, "colocated", "--rollout_is=token", steps=2)
    assert sequential[0]["reward/score_mean"] == colocated[0]["reward/score_mean"]   # step 1: the same batch
    assert sequential[1]["actor/pg_loss"] != pytest.approx(colocated[1]["actor/pg_loss"])   # then a stale one


@pytest.mark.slow
@pytest.mark.parametrize("slow_side", ["rollout", "trainer"])
def test_staleness_never_exceeds_max_staleness(tmp_path, slow_side):
    extra = ["--rollout_mode=async", "--max_staleness=2", "--rollout_bypass_mode=true"]
    extra += ["--rollout_delay_s=0.5"] if slow_side == "rollout" else ["--ppo_epochs=4"]
    records = train(tmp_path, slow_side, *extra, steps=4)
    assert len(records) == 4
    for r in records:
        assert 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= 2, r
        assert r["rollout/staleness_max"] <= r["step"] - 1   # never older than the first weights
        assert all(math.isfinite(v) for v in r.values())


@pytest.mark.slow
def test_vllm_on_the_rollout_side_samples_what_the_colocated_vllm_engine_samples(tmp_path):
    """A vLLM engine in the rollout process, its weights reloaded in place from the buckets, and its
    per-request seeds the ones the trainer's colocated vLLM engine would have used (the counter of
    that engine, kept by the trainer): with max_staleness 0 the run logs the colocated vLLM run's
    numbers, step by step."""
    extra = ("--rollout_engine=vllm", "--rollout_kv_cache_gb=0.25", "--rollout_sync_bucket_mb=0.5")
    colocated = train(tmp_path, "colocated", *extra, steps=2)
    asynchronous = train(tmp_path, "async", *extra, "--rollout_mode=async", "--max_staleness=0", steps=2)
    assert_same_run(colocated, asynchronous)
    assert abs(colocated[-1]["kl/mean"]) > 1e-4   # the policy moved: the later batches test the weight sync


def _pids(stdout_path: Path) -> list[int]:
    text = stdout_path.read_text() if stdout_path.exists() else ""
    return [int(line.split("(pid ")[1].rstrip(")")) for line in text.splitlines() if line.startswith("rollout process")]


def _start_long_run(tmp):
    out, log = tmp / "out", tmp / "stdout.txt"
    proc = forkserver.Popen(command(out, "--total_training_steps=200", "--rollout_mode=async", "--max_staleness=0",
                                    "--rollout_delay_s=0.2"),
                            cwd=tmp, env=env_for(tmp), stdout=log.open("w"), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    return proc, _pids(log)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_killed_rollout_process_ends_the_run_with_one_line(tmp_path):
    proc, pids = _start_long_run(tmp_path)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rollout process 0 (pid {pids[0]}) ended (killed by SIGKILL): the run stops; resume "
                      f"with the same command"], stderr[-3000:]
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_killed_trainer_ends_the_rollout_process(tmp_path):
    proc, pids = _start_long_run(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 60
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


REFUSED = [
    (["--rollout_mode=one_step_off"], "rollout_bypass_mode=true"),
    (["--rollout_mode=async", "--max_staleness=1"], "rollout_is=token|sequence"),
    (["--rollout_mode=async", "--max_staleness=0", "--partial_rollout=true"], "partial_rollout=true"),
    (["--rollout_mode=async", "--max_staleness=0", "--tools=rollout.tools.builtin:calculator"], "tools="),
    (["--rollout_mode=async", "--max_staleness=0", "--filter_groups_enable=true"], "filter_groups_enable=True"),
    (["--rollout_mode=async", "--max_staleness=0", "--ulysses_sequence_parallel_size=2"],
     "ulysses_sequence_parallel_size=2"),
    (["--rollout_mode=async", "--max_staleness=0", "--rollout_tensor_model_parallel_size=2"],
     "rollout_tensor_model_parallel_size=2"),
    (["--rollout_mode=async", "--max_staleness=0", "--kl_rollback_threshold=0.5"], "kl_rollback_threshold=0.5"),
    (["--rollout_mode=sometimes"], "rollout_mode must be one of"),
    (["--rollout_processes=-1"], "rollout_processes must be >= 0"),
]


@pytest.mark.parametrize("args,named", REFUSED)
def test_what_the_asynchronous_modes_do_not_run_is_refused_in_one_line(args, named):
    from config import load_config
    from errors import UserError
    with pytest.raises(UserError) as e:
        load_config(args)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("--rollout_mode=one_step_off", "--rollout_is=token"),
                                  ("--rollout_mode=async", "--max_staleness=0")], ids=["one_step_off", "async0"])
def test_a_run_killed_and_resumed_logs_the_uninterrupted_runs_numbers(tmp_path, mode):
    """SIGKILL of the trainer (its rollout process goes with it) after step 3, checkpoints every 2
    steps: the resumed run trains on the batches that were in flight at the checkpoint (saved with
    their versions) and must log exactly what the uninterrupted run logged."""
    extra = [*mode, "--total_training_steps=4", "--save_freq=2", "--rollout_delay_s=0.3"]
    reference = train(tmp_path, "reference", *extra, steps=4)
    out = tmp_path / "killed"
    proc = forkserver.Popen(command(out, *extra), cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    metrics = out / "metrics.jsonl"
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        assert proc.poll() is None
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=60)
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert saved, "killed before the first checkpoint"
    resumed = train(tmp_path, "killed", *extra, steps=4, said=f"resuming from {saved[-1]}")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in rs]   # noqa: E731
    assert strip(resumed) == strip(reference)


def test_the_weight_sync_group_is_torchs_own_and_imports_no_vllm():
    """Rank 0 serving the store on its pre-bound socket and a rollout side joining (threads here, processes
    in a run): a bucket broadcast from rank 0 arrives whole, and an hf-engine run imports no vLLM for it."""
    code = textwrap.dedent("""
        import socket, sys, threading, torch
        from rollout.asynchronous import weights_group
        listener = socket.create_server(("127.0.0.1", 0))
        port, got = listener.getsockname()[1], torch.zeros(6)
        def rollout_side():
            weights_group(port, 1, 2).broadcast(got, 0).wait()
        side = threading.Thread(target=rollout_side)
        side.start()
        weights_group(port, 0, 2, listener).broadcast(torch.arange(6.0), 0).wait()
        side.join(60)
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], got
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "vllm imported"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_phase_model_reads_colocated_and_overlapped_runs():
    from plumbing.phase_model import phase_times, predict
    colocated = [{"step": 1, "time/step_s": 99.0, "time/gen_s": 50.0, "time/sync_s": 1.0},   # warm-up: left out
                 {"step": 2, "time/step_s": 10.0, "time/gen_s": 3.0, "time/sync_s": 1.0}]
    assert phase_times(colocated) == {"gen": 3.0, "train": 6.0, "sync": 1.0}
    overlapped = [{"step": 1, "time/step_s": 9.0, "time/wait_rollout_s": 2.0, "time/sync_s": 0.5, "rollout/gen_s": 4.0}]
    assert phase_times(overlapped) == {"gen": 4.0, "train": 6.5, "sync": 0.5}
    steps = predict(3.0, 6.0, 1.0)
    assert steps["colocated"] == 10.0 and steps["one_step_off"] == 7.0 and steps["async (max_staleness 0)"] == 10.0
    assert predict(8.0, 2.0, 1.0)["one_step_off"] == 9.0   # generation-bound: the trainer waits


def test_dry_run_predicts_each_mode_from_the_last_runs_metrics(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "val/accuracy": 0.1},
        {"step": 1, "time/step_s": 10.0, "time/gen_s": 5.0, "time/sync_s": 0.0, "perf/peak_rss_gb/setup": 0.9,
         "perf/peak_rss_gb/gen": 1.0, "perf/peak_rss_gb/update": 1.25, "perf/peak_rss_gb": 1.25},
        {"step": 2, "time/step_s": 10.0, "time/gen_s": 5.0, "time/sync_s": 0.0, "perf/peak_rss_gb/gen": 1.3,
         "perf/peak_rss_gb/update": 1.5, "perf/peak_rss_gb/sync": float("nan"), "perf/peak_rss_gb": 1.5},
        {"step": 3, "time/step_s": 10.0, "time/gen_s": 5.0, "time/sync_s": 0.0, "perf/peak_rss_gb/gen": 1.5,
         "perf/peak_rss_gb/update": 1.5, "perf/peak_rss_gb/sync": 1.5, "perf/peak_rss_gb": 1.5}]) + "\n")
    proc = forkserver.run([sys.executable, str(SCRIPT), "--dry_run", f"--output_dir={out}"], cwd=tmp_path,
                          env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generation 5.00 s, training 5.00 s, sync 0.00 s per step" in proc.stdout
    assert "one_step_off                    5.00 s/step  (2.00x colocated)" in proc.stdout
    # the peak memory per phase in step 2, the first to reach the run's peak (a NaN: no figure)
    assert "GB, in step 2, the first to reach the run's peak" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [["setup", "0.90"], ["gen", "1.30"], ["update", "1.50"], ["whole", "run", "1.50"]] == [
        r for r in rows if r[:1] in (["setup"], ["gen"], ["update"], ["sync"], ["whole"])], proc.stdout
    assert "the host RSS peak is set in update" in proc.stdout


def launch(tmp, name, processes, *extra, steps=2):
    """A run under `accelerate launch` with ZeRO-3 over `processes` training processes -> its records."""
    out = tmp / name
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", str(processes), str(SCRIPT),
           *command(out, f"--total_training_steps={steps}", *extra)[2:]]
    proc = forkserver.run(cmd, cwd=ROOT, env=env_for(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DeepSpeed ZeRO-3" in proc.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_training_processes_take_what_their_colocated_engines_would_sample(tmp_path):
    """Two training processes under `accelerate launch` (torchelastic: the rollout side's group must
    not use the launcher's store), ZeRO-3 over both, and three rollout processes, whose parts of the
    batch straddle the ranks' shares: each share is sampled with its rank's seed and handed to it,
    every rank runs the gathers of the weight sync (0.5 MB buckets), so with max_staleness 0 the run
    logs what the colocated two-process run logs, step by step."""
    colocated = launch(tmp_path, "colocated", 2)
    asynchronous = launch(tmp_path, "async", 2, "--rollout_mode=async", "--max_staleness=0", "--rollout_processes=3",
                          "--rollout_sync_bucket_mb=0.5")
    assert_same_run(colocated, asynchronous)
    assert abs(colocated[-1]["kl/mean"]) > 1e-4   # the policy moved: the later batches test the weight sync
