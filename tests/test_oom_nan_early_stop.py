"""Issue 21, sections 3 and 4: the OOM reaction (plumbing/oom.py), the NaN clip reaction and early
stop (plumbing/guards.py), end to end on the demo.

The OOMs are real torch.OutOfMemoryError raised by the code's one test switch, FLAT_PPO_TEST_OOM
("RANK:N": that rank's log-prob passes fail on a micro-batch of more than N tokens, right after the
model's forward; forward/readouts.py). The NaN steps come from real autograd with a NaN gradient
fed in through sitecustomize (the repo's way of injecting faults from outside the trainer)."""
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

import forkserver
from config import load_config
from plumbing.guards import Guards
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
ZERO3 = ROOT / "accelerate_configs" / "zero3.yaml"
# ignore_eos: every sequence is 6 + 4 = 10 tokens, so a micro-batch of 8 has 80 and one of 6 has 60
RUN = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
       "--ppo_epochs=1", "--rollout_ignore_eos=true", "--max_response_length=4", "--test_freq=-1",
       "--val_before_train=false", "--mlflow_log_model=false"]
OOM_ABOVE_70_ON_RANK0 = {"FLAT_PPO_TEST_OOM": "0:70"}


def env_for(tmp_path, **extra):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    env.pop("FLAT_PPO_TEST_OOM", None)
    env.update(extra)
    return env


def run1(tmp_path, *args, env_extra=None, timeout=600):
    return forkserver.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env_for(tmp_path, **(env_extra or {})),
                          capture_output=True, text=True, timeout=timeout)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tail(proc):
    return proc.stdout[-3000:] + proc.stderr[-5000:]


def same(rs):   # what must not depend on the OOMs: everything but clocks and the guard's own figures
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "guard/"))} for r in rs]


# ----------------------------------------------------------------------------------------------
# 3. OOM reaction
@pytest.mark.slow
def test_zero3_oom_on_one_rank_is_agreed_and_the_run_goes_on_with_smaller_micro_batches(tmp_path):
    """2-process ZeRO-3; only rank 0 raises OutOfMemoryError (micro-batches of 80 tokens > 70), in
    the old log-prob passes and in the actor update. Both ranks must agree (no hang: the launch has
    a timeout), redo each phase with 8 -> 6 sequences, finish, and checkpoint the new sizes."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3), "--main_process_port",
           str(free_port()), str(SCRIPT), f"--output_dir={out}", "--total_training_steps=2",
           "--save_freq=2", *RUN]
    proc = forkserver.run(cmd, cwd=ROOT, env=env_for(tmp_path, **OOM_ABOVE_70_ON_RANK0), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, tail(proc)
    print(proc.stderr[-4000:])   # the log lines, for the record (pytest -s)
    warned = [line for line in proc.stderr.splitlines() if "out of memory in phase" in line]
    assert len(warned) == 2, proc.stderr[-3000:]   # said once, by the main process, per reaction
    assert "phase log_prob" in warned[0] and "phase actor" in warned[1]
    assert all("micro-batch size 6 (was micro-batch size 8" in line for line in warned)
    logged = records(out)
    assert [r["step"] for r in logged] == [1, 2]
    assert [r["guard/oom"] for r in logged] == [2.0, 0.0]
    for r in logged:
        assert r["guard/oom_micro_batch_size/log_prob"] == 6.0 and r["guard/oom_micro_batch_size/actor"] == 6.0
        assert r["guard/oom_micro_batch_size/critic"] == 8.0   # the critic's passes never failed
        assert r["actor/skipped_steps"] == 0 and math.isfinite(r["actor/pg_loss"])
    state = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["oom"]["sizes"] == {"log_prob": [6, 0], "actor": [6, 0], "critic": [8, 0]}


def zero3_run(tmp_path, out, *args, oom=None):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3), "--main_process_port",
           str(free_port()), str(SCRIPT), f"--output_dir={out}", *RUN, "--adv_estimator=grpo",
           "--use_kl_in_reward=false", *args]
    return forkserver.run(cmd, cwd=ROOT, env=env_for(tmp_path, **({"FLAT_PPO_TEST_OOM": oom} if oom else {})),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_zero3_oom_in_the_sft_forward_on_one_rank_is_agreed_before_its_backward(tmp_path):
    """The SFT mix's forward and backward are two passes: rank 0 runs out of memory in the forward
    of step 1's first SFT pass (its 8 rows hold more than 30 tokens; PPO's micro-batches of 2 hold
    20) while rank 1 would go on into the backward's collectives. Both must agree first (no
    collective mismatch, no hang), redo the mini-batch on the same SFT rows, and train exactly as a
    run configured with the smaller size from the start."""
    import pandas as pd
    sft = tmp_path / "sft.parquet"
    pd.DataFrame({"prompt": [f"{a}+{a}=" for a in range(10, 42)],
                  "response": [str(2 * a) for a in range(10, 42)]}).to_parquet(sft)
    mix = ["--total_training_steps=2", f"--sft_files={sft}", "--sft_coef=1.0", "--sft_batch_size=16",
           "--log_prob_micro_batch_size_per_device=2"]
    proc = zero3_run(tmp_path, tmp_path / "oom", *mix, "--ppo_micro_batch_size_per_device=2", oom="0:30:1")
    assert proc.returncode == 0, tail(proc)
    warned = [line for line in proc.stderr.splitlines() if "out of memory in phase" in line]
    assert len(warned) == 1 and "phase actor" in warned[0], tail(proc)
    plain = zero3_run(tmp_path, tmp_path / "plain", *mix, "--ppo_micro_batch_size_per_device=1")
    assert plain.returncode == 0, tail(plain)
    reacted = records(tmp_path / "oom")
    assert [r["guard/oom"] for r in reacted] == [1.0, 0.0]
    assert same(reacted) == same(records(tmp_path / "plain"))   # the same SFT rows, not the next ones


@pytest.mark.slow
def test_zero3_oom_in_the_entropy_guards_pass_on_one_rank_is_agreed_before_the_training_forward(tmp_path):
    """With the entropy reaction on (from step 2: entropy_floor far above any entropy), each
    micro-batch of the first epoch has two forward passes, the guard's at the configured temperature
    and the training one. Rank 0 runs out of memory in the guard's pass of step 2 (its 3rd pass of
    over 70 tokens: step 1 trains 2 micro-batches of 80): both ranks agree before the training
    forward's ZeRO-3 gathers, and the run goes on."""
    proc = zero3_run(tmp_path, tmp_path / "out", "--total_training_steps=2", "--entropy_floor=100",
                     "--entropy_floor_temperature=1.5", "--log_prob_micro_batch_size_per_device=2", oom="0:70:3")
    assert proc.returncode == 0, tail(proc)
    warned = [line for line in proc.stderr.splitlines() if "out of memory in phase" in line]
    assert len(warned) == 1 and "step 2" in warned[0] and "phase actor" in warned[0], tail(proc)
    logged = records(tmp_path / "out")
    assert [r["guard/oom"] for r in logged] == [0.0, 1.0]
    assert all(math.isfinite(r["guard/entropy"]) and math.isfinite(r["actor/pg_loss"]) for r in logged)


@pytest.mark.slow
def test_an_oom_redo_trains_exactly_like_the_smaller_size_and_its_sizes_resume(tmp_path):
    """The redone step is the step at the smaller size (no partial update, no doubled work): a run
    that runs out of memory at 8 sequences equals one configured with 6 from the start, metric for
    metric; stopped after step 2 and resumed without the switch, it keeps 6 (from the checkpoint)."""
    oom, plain = tmp_path / "oom", tmp_path / "plain"
    # critic-free: the critic's own sizes would differ between the two runs (it never runs out here)
    grpo = ["--adv_estimator=grpo", "--use_kl_in_reward=false", *RUN]
    first = run1(tmp_path, f"--output_dir={oom}", "--total_training_steps=2", "--save_freq=2", *grpo,
                 env_extra=OOM_ABOVE_70_ON_RANK0)
    assert first.returncode == 0, tail(first)
    resumed = run1(tmp_path, f"--output_dir={oom}", "--total_training_steps=3", "--save_freq=2", *grpo)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, tail(resumed)
    proc = run1(tmp_path, f"--output_dir={plain}", "--total_training_steps=3", *grpo,
                "--ppo_micro_batch_size_per_device=6")
    assert proc.returncode == 0, tail(proc)
    reacted = records(oom)
    assert [r["guard/oom"] for r in reacted] == [2.0, 0.0, 0.0]
    assert all(r["guard/oom_micro_batch_size/actor"] == 6.0 for r in reacted)   # step 3: restored, not 8
    assert same(reacted) == same(records(plain))


@pytest.mark.slow
def test_oom_after_max_oom_retries_in_a_row_stops_with_one_line_naming_the_phase_and_keys(tmp_path):
    """Every micro-batch fails (more than 5 tokens): 8 -> 6 -> 4, then the third OOM in a row stops
    the run with one line, no traceback."""
    proc = run1(tmp_path, f"--output_dir={tmp_path / 'out'}", "--total_training_steps=2", "--max_oom_retries=2",
                *RUN, env_extra={"FLAT_PPO_TEST_OOM": "0:5"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, tail(proc)
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert "out of memory in phase log_prob 3 time(s) in a row, down to micro-batch size 4" in error[0]
    assert "lower log_prob_micro_batch_size_per_device" in error[0]


CPU_OOM = """
import resource, sys, torch
from accelerate import Accelerator
from plumbing.oom import OomReaction

# the address space this process has, plus 1.5 GB: a real allocation past it fails in torch's
# DefaultCPUAllocator (a RuntimeError, not torch.OutOfMemoryError), as a CPU run out of memory does
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 1500 * 2**20, resource.RLIM_INFINITY))
oom = OomReaction(Accelerator(cpu=True), {"actor": [8, 0]}, max_retries=3)
tried = []


def work():   # a micro-batch's activations: 300 MB a sequence (8 and 6 do not fit, 4 does)
    micro, _ = oom.size("actor")
    tried.append(micro)
    with oom.agreed("actor"):
        torch.empty(micro * 300 * 2**20, dtype=torch.uint8)


oom.retry("actor", work)
print("tried", tried, "guard/oom", oom.metrics()["guard/oom"])
"""


def test_a_cpu_allocation_failure_is_an_oom_the_reaction_redoes(tmp_path):
    """On a CPU, running out of memory raises RuntimeError("DefaultCPUAllocator: can't allocate
    memory"), not torch.OutOfMemoryError; the reaction must take it for what it is. Real: a process
    whose address space is capped, asking for more than fits at 8 and 6 sequences."""
    proc = forkserver.run([sys.executable, "-c", CPU_OOM], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    assert "tried [8, 6, 4] guard/oom 2.0" in proc.stdout, tail(proc)
    warned = [line for line in proc.stderr.splitlines() if "out of memory in phase actor" in line]
    assert len(warned) == 2 and "micro-batch size 4 (was micro-batch size 6" in warned[1], tail(proc)


# ----------------------------------------------------------------------------------------------
# 4. NaN clip reaction
NAN_GRADIENTS = """
import os, torch
_backward, _calls = torch.autograd.backward, [0]


def backward(tensors, grad_tensors=None, *args, **kwargs):
    # the actor's 4 backward passes of steps 1 and 3 (grpo: no critic) get a NaN gradient
    _calls[0] += 1
    if _calls[0] in (1, 2, 3, 4, 9, 10, 11, 12):
        grad_tensors = torch.full_like(tensors, float("nan"))
    return _backward(tensors, grad_tensors, *args, **kwargs)


torch.autograd.backward = backward
"""


@pytest.mark.slow
def test_nan_clip_reaction_tightens_clipping_until_a_clean_stretch_and_resumes(tmp_path):
    """Steps 1 and 3 are skipped (NaN gradients): clipping is 0.5 from step 2, the skip at step 3
    starts the clean stretch again (no flapping back to 1.0 at step 4), and after 2 clean steps
    (4 and 5) step 6 clips at 1.0 again. Resumed from its own step-3 checkpoint (without the
    injection, which only touched steps 1 and 3), the run carries on in the same state."""
    (tmp_path / "sitecustomize.py").write_text(NAN_GRADIENTS)
    react = ["--adv_estimator=grpo", "--use_kl_in_reward=false", "--nan_clip_reaction=true",
             "--nan_clip_clean_steps=2", *RUN]
    sub = lambda steps, out, inject: forkserver.run(   # noqa: E731
        [sys.executable, str(SCRIPT), f"--output_dir={out}", f"--total_training_steps={steps}", "--save_freq=3",
         *react], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=env_for(tmp_path, **({"PYTHONPATH": str(tmp_path)} if inject else {})))
    whole = sub(6, tmp_path / "whole", True)
    assert whole.returncode == 0, tail(whole)
    logged = records(tmp_path / "whole")
    assert [r["actor/skipped_steps"] for r in logged] == [2, 0, 2, 0, 0, 0]
    assert [r["guard/max_grad_norm"] for r in logged] == [1.0, 0.5, 0.5, 0.5, 0.5, 1.0]
    assert [r["guard/nan_clip_reaction"] for r in logged] == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert whole.stderr.count("(nan_clip_reaction)") == 2   # on once, off once
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "whole", split)
    shutil.rmtree(split / "checkpoints" / "step_6")   # as if stopped after step 3
    resumed = sub(6, split, False)
    assert resumed.returncode == 0, tail(resumed)
    assert f"resuming from {split / 'checkpoints' / 'step_3'}" in resumed.stdout, tail(resumed)
    assert same(records(split)) == same(logged)
    assert [r["guard/max_grad_norm"] for r in records(split)] == [1.0, 0.5, 0.5, 0.5, 0.5, 1.0]


# ----------------------------------------------------------------------------------------------
# 4. early stop
@pytest.mark.slow
def test_early_stop_patience_stops_with_a_final_checkpoint_and_says_why(tmp_path):
    """An actor_lr too small to move the weights: the validation score after step 1 equals the one
    before training, so with early_stop_patience=1 the run stops there, saves a checkpoint and the
    final model, and says which rule fired (console, MLflow tag)."""
    out = tmp_path / "out"
    proc = run1(tmp_path, f"--output_dir={out}", "--total_training_steps=5", "--actor_lr=1e-12", "--critic_lr=1e-12",
                "--early_stop_patience=1", *[a for a in RUN if "test_freq" not in a and "val_before" not in a],
                "--test_freq=1")
    assert proc.returncode == 0, tail(proc)
    assert [r["step"] for r in records(out)] == [0, 1]
    assert (out / "checkpoints" / "step_1" / "trainer_state.json").is_file() and (out / "final").is_dir()
    assert "early stop after step 1: early_stop_patience" in proc.stdout
    assert "stopped early: early_stop_patience: val/accuracy has not improved" in proc.stdout
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    run = mlflow.search_runs(experiment_names=["ppo"], output_format="list")[0]
    assert run.data.tags["stop_reason"].startswith("early_stop_patience") and run.info.status == "FINISHED"


def guards(*args):
    return Guards(load_config([*args, "--total_training_steps=100"]))


def test_early_stop_on_flat_losses_counts_steps_in_a_row():
    g = guards("--early_stop_loss_rtol=1e-4", "--early_stop_loss_steps=2")
    flat = lambda x: {"actor/pg_loss": x, "critic/vf_loss": 2.0}   # noqa: E731
    assert g.early_stop(1, flat(1.0)) is None
    assert g.early_stop(2, flat(1.00005)) is None          # 1 flat step
    assert g.early_stop(3, flat(1.1)) is None              # a real change starts the count again
    assert g.early_stop(4, flat(1.10001)) is None
    assert "early_stop_loss_rtol" in g.early_stop(5, flat(1.1))
    off = guards()
    assert all(off.early_stop(s, flat(1.0)) is None for s in range(1, 20))   # off by default


def test_early_stop_patience_counts_validations_without_improvement_only():
    g = guards("--early_stop_patience=2")
    assert g.early_stop(0, {"val/accuracy": 0.2}) is None
    assert g.early_stop(1, {"actor/pg_loss": 0.1}) is None       # no validation: nothing counted
    assert g.early_stop(2, {"val/accuracy": 0.2}) is None        # not improved: 1
    assert g.early_stop(3, {"val/accuracy": 0.3}) is None        # improved: 0
    assert g.early_stop(4, {"val/accuracy": 0.25}) is None
    assert "early_stop_patience" in g.early_stop(5, {"val/accuracy": 0.3})
