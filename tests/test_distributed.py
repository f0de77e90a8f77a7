"""Multi-process runs: `accelerate launch` with DeepSpeed ZeRO-3 on 2 CPU processes (gloo).

Checks that the run finishes, that each rank held only half of the actor's parameters, that the
logged metrics are reduced over both ranks, that only the main process wrote metrics.jsonl, and
that final/ holds the gathered full model.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ignore_eos makes every response exactly 4 tokens; "NN+NN=" prompts are 6 tokens
RUN = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
       "--ppo_epochs=1", "--total_training_steps=2", "--test_freq=2", "--rollout_ignore_eos=true",
       "--max_response_length=4"]
TOKENS_PER_STEP = 16 * 2 * (6 + 4)   # all ranks together

USER_STYLE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  gradient_accumulation_steps: 1
machine_rank: 0
num_machines: 1
num_processes: 2
main_training_function: main
"""


def launch(tmp_path, accel_config, *args):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel_config),
           "--main_process_port", str(29500 + os.getpid() % 1000), str(ROOT / "train_ppo.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("style", ["repo_json", "user_yaml"])
def test_zero3_two_processes(tmp_path, style):
    if style == "repo_json":
        accel_config = ROOT / "accelerate_configs" / "zero3.yaml"
    else:   # what `accelerate config` writes: ZeRO settings as YAML keys, no JSON file
        accel_config = tmp_path / "accelerate.yaml"
        accel_config.write_text(USER_STYLE_CONFIG)
    out = tmp_path / "out"
    proc = launch(tmp_path, accel_config, f"--output_dir={out}", *RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    shares = re.findall(r"rank (\d)/2: actor holds (\d+) of (\d+) parameters", proc.stdout + proc.stderr)
    assert sorted(int(r) for r, _, _ in shares) == [0, 1]
    for _, local, total in shares:   # ZeRO-3: each rank keeps about half of every parameter
        assert int(local) / int(total) == pytest.approx(0.5, abs=0.02)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]          # one writer: no duplicated lines
    for r in records[1:]:
        assert all(math.isfinite(v) for v in r.values())
        # tokens of both ranks: a rank-local figure would be half of this
        assert r["perf/tokens_per_s"] * r["time/step_s"] == pytest.approx(TOKENS_PER_STEP, rel=1e-6)
        assert r["kl/mean"] >= 0 and "critic/vf_loss" in r and "actor/pg_loss" in r
    assert "val/accuracy" in records[0] and "val/accuracy" in records[2]

    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "demo_model")
    assert sum(p.numel() for p in final.parameters()) == sum(p.numel() for p in start.parameters())
    assert any(not (a == b).all() for a, b in zip(final.parameters(), start.parameters()))


def test_world_size_that_does_not_divide_the_batch_is_named(tmp_path):
    proc = launch(tmp_path, ROOT / "accelerate_configs" / "zero3.yaml", f"--output_dir={tmp_path}/out",
                  "--train_batch_size=15", "--ppo_mini_batch_size=5", "--total_training_steps=1")
    assert proc.returncode != 0
    assert "train_batch_size=15 is not divisible by the 2 processes" in proc.stderr


def test_deepspeed_json_that_contradicts_the_script_is_named(tmp_path):
    conf = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    conf["train_micro_batch_size_per_gpu"] = 4
    (tmp_path / "ds.json").write_text(json.dumps(conf))
    accel = (ROOT / "accelerate_configs" / "zero3.yaml").read_text().replace("ds_configs/zero3.json",
                                                                            str(tmp_path / "ds.json"))
    (tmp_path / "accel.yaml").write_text(accel)
    proc = launch(tmp_path, tmp_path / "accel.yaml", f"--output_dir={tmp_path}/out",
                  "--ppo_micro_batch_size_per_device=8", "--total_training_steps=1")
    assert proc.returncode != 0
    assert "train_micro_batch_size_per_gpu=4 but ppo_micro_batch_size_per_device=8" in proc.stderr


def test_zero3_two_processes_with_vllm(tmp_path):
    """One in-process vLLM engine per rank, weights gathered from ZeRO-3 shards bucket by bucket."""
    out = tmp_path / "out"
    proc = launch(tmp_path, ROOT / "accelerate_configs" / "zero3.yaml", f"--output_dir={out}", *RUN,
                  "--rollout_engine=vllm", "--rollout_sync_bucket_mb=0.5", "--rollout_max_logprob_diff=0.01")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["rollout/logprob_diff"] < 1e-3
    assert records[2]["kl/mean"] > 0


def test_zero3_checkpoint_resume_continues_like_the_uninterrupted_run(tmp_path):
    """DeepSpeed checkpoints of every rank's shards: 2 steps, stop, resume to 4 == 4 straight."""
    args = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
            "--test_freq=-1", "--save_freq=2"]
    config = ROOT / "accelerate_configs" / "zero3.yaml"
    for out, steps in (("full", 4), ("part", 2), ("part", 4)):
        proc = launch(tmp_path, config, f"--output_dir={tmp_path / out}", f"--total_training_steps={steps}", *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resuming from" in proc.stdout
    same = lambda out: [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
                        for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in same("part")] == [0, 1, 2, 3, 4]
    assert same("part") == same("full")


@pytest.mark.parametrize("config", ["zero2", "zero3_offload"])
def test_other_repository_configs_train(tmp_path, config):
    out = tmp_path / "out"
    proc = launch(tmp_path, ROOT / "accelerate_configs" / f"{config}.yaml", f"--output_dir={out}", *RUN,
                  "--ref_offload=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(v) for r in records for v in r.values())
