"""Reliability under several processes and guards (issue 19, section 1): every rank reduces the
same metric keys whatever its data, the entropy reaction does not flap, rollout_on_drift=regenerate
keeps vLLM asleep and sends the weights once, a one-rank vLLM failure does not hang setup, the dry
run counts the hf engine's gathered actor under ZeRO-3, and the guards' advice resumes."""
import json
import math
import os
import sys
from pathlib import Path

import pytest
from ports import free_port

import forkserver

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
ZERO3 = ROOT / "accelerate_configs" / "zero3.yaml"

# ignore_eos makes every response exactly 4 tokens; per step and rank: 2 actor mini-batches
RUN2 = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
        "--ppo_epochs=1", "--rollout_ignore_eos=true", "--max_response_length=4", "--test_freq=-1",
        "--val_before_train=false", "--mlflow_log_model=false"]
FAST = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
        "--ppo_epochs=1", "--test_freq=-1", "--val_before_train=false", "--mlflow_log_model=false"]


def env_for(tmp_path, **extra):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def launch2(tmp_path, *args, env_extra=None, timeout=900):
    """A 2-process ZeRO-3 launch of train_ppo.py."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3),
           "--main_process_port", str(free_port()), str(SCRIPT), *args]
    return forkserver.run(cmd, cwd=ROOT, env=env_for(tmp_path, **(env_extra or {})), capture_output=True, text=True,
                          timeout=timeout)


def run1(tmp_path, *args, timeout=600):
    """A single-process run of train_ppo.py."""
    return forkserver.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env_for(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tail(proc):
    return proc.stdout[-3000:] + proc.stderr[-5000:]


# ----------------------------------------------------------------------------------------------
# 1. a metric NaN for a whole step on one rank
NAN_LOSS_ON_RANK0 = """
import os
if os.environ.get("RANK") == "0":
    import torch
    _logsumexp = torch.logsumexp

    def logsumexp(*args, **kwargs):   # the log-probs of the update's passes (with grad) are NaN on rank 0
        out = _logsumexp(*args, **kwargs)
        return out * float("nan") if torch.is_grad_enabled() else out

    torch.logsumexp = logsumexp
"""


@pytest.mark.slow
def test_zero3_nan_loss_on_one_rank_reduces_the_same_keys_everywhere(tmp_path):
    """The actor's loss is NaN on rank 0 in every update pass (injected from outside the trainer,
    through sitecustomize), so its actor/pg_loss is NaN for whole steps there while rank 1's is
    finite: both ranks must still reduce the same keys (no hang, no value under another name),
    every actor step is skipped on both ranks, and the weights never take the NaN."""
    (tmp_path / "sitecustomize.py").write_text(NAN_LOSS_ON_RANK0)
    out = tmp_path / "out"
    proc = launch2(tmp_path, f"--output_dir={out}", "--total_training_steps=2", *RUN2,
                   env_extra={"PYTHONPATH": str(tmp_path)}, timeout=600)
    assert proc.returncode == 0, tail(proc)
    logged = records(out)
    assert [r["step"] for r in logged] == [1, 2]
    assert set(logged[0]) == set(logged[1])
    for r in logged:
        assert {"actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy"} <= set(r)
        # each value under its own name: these would be some other metric's if the keys were shifted
        assert r["actor/skipped_steps"] == 2 and r["actor/lr"] == pytest.approx(5e-5, rel=1e-6)
        assert r["kl/coef"] == pytest.approx(0.001, rel=1e-6) and r["rollout/response_len_mean"] == 4.0
        assert math.isfinite(r["actor/pg_loss"])   # rank 1's: rank 0 had none that was finite
        assert math.isnan(r["actor/grad_norm"])    # no step of any rank had a finite norm
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "demo_model")
    assert all(p.isfinite().all() for p in final.parameters())
    assert all((a == b).all() for a, b in zip(final.parameters(), start.parameters()))   # every step skipped


# ----------------------------------------------------------------------------------------------
# 6. the guards' advice resumes
@pytest.mark.slow
def test_a_run_a_guard_stopped_resumes_with_the_advised_change(tmp_path):
    """kl_rollback_threshold below any real KL with max_rollbacks=0: the guard stops the run at
    step 2 advising to lower actor_lr or raise kl_rollback_threshold. The same command with both
    changed resumes from step 1's checkpoint, says the keys are safe to change, trains at the new
    learning rate and finishes; a key that changes the run's shapes is still refused."""
    out = tmp_path / "out"
    common = [f"--output_dir={out}", "--total_training_steps=3", "--save_freq=1", "--max_rollbacks=0", *FAST]
    stopped = run1(tmp_path, *common, "--kl_rollback_threshold=1e-6")
    assert stopped.returncode != 0 and "Traceback" not in stopped.stderr
    assert "lower actor_lr or raise kl_rollback_threshold" in stopped.stderr, stopped.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_1"]

    refused = run1(tmp_path, *common, "--kl_rollback_threshold=1.0", "--max_response_length=5")
    assert refused.returncode != 0 and "max_response_length: 4 -> 5" in refused.stderr, refused.stderr[-2000:]

    resumed = run1(tmp_path, *common, "--kl_rollback_threshold=1.0", "--actor_lr=2.5e-5")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert "actor_lr changed from 5e-05 to 2.5e-05" in resumed.stdout and "safe to change on resume" in resumed.stdout
    logged = records(out)
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert logged[0]["actor/lr"] == pytest.approx(5e-5, rel=1e-6)
    assert [r["actor/lr"] for r in logged[1:]] == pytest.approx([2.5e-5, 2.5e-5], rel=1e-6)
    assert logged[2]["kl/mean"] > 1e-6   # above the old threshold: the raised one let it go on


# ----------------------------------------------------------------------------------------------
# 3. rollout_on_drift=regenerate: vLLM sleeps while the hf engine samples and the models train
REGENERATE_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import train_ppo
import config

cfg = config.load_config(sys.argv[3:])
run = train_ppo.setup(cfg)
vllm, events = run.engine, []
hf = train_ppo.hf_engine(run)


def spy(obj, name, label):
    # the real method runs; the call is recorded with the vLLM engine's own state at that moment
    real = getattr(obj, name)

    def call(*args, **kwargs):
        events.append({"call": label, "args": [a for a in args if isinstance(a, list) and all(
            isinstance(t, str) for t in a)], "asleep": sorted(vllm._sleeping)})
        return real(*args, **kwargs)
    setattr(obj, name, call)


for name in ("generate", "sleep", "wake_up", "load_weights"):
    spy(vllm, name, "vllm." + name)
spy(hf, "generate", "hf.generate")
for role, (_, optim, _) in run.trained.items():
    spy(optim, "step", role + ".step")
try:
    for step in (1, 2):
        events.append({"call": "step", "step": step})
        metrics = train_ppo.train_step(run, step)
        events.append({"call": "regenerated", "value": metrics["rollout/regenerated"]})
finally:
    run.tracker.finish("FINISHED", None)
    run.engine.shutdown()
open(sys.argv[2], "w").write(json.dumps(events))
"""


@pytest.mark.slow
def test_regenerate_keeps_vllm_asleep_and_sends_the_weights_once_per_step(tmp_path):
    """A drift threshold below fp32 rounding makes every step regenerate. The real vLLM engine's
    methods are wrapped (not replaced) to record each call with the engine's own sleep state: per
    step one generate, then sleep; the hf engine's generation and every optimizer step find vLLM
    asleep (weights and KV cache); then one wake of the weights, one load_weights, one wake of
    the KV cache."""
    driver, log = tmp_path / "driver.py", tmp_path / "events.json"
    driver.write_text(REGENERATE_DRIVER)
    proc = forkserver.run([sys.executable, str(driver), str(ROOT), str(log), f"--output_dir={tmp_path}/out",
                           "--rollout_engine=vllm", "--rollout_max_logprob_diff=1e-12", "--rollout_on_drift=regenerate",
                           "--total_training_steps=2", *FAST], cwd=tmp_path, env=env_for(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, tail(proc)
    events = json.loads(log.read_text())
    starts = [i for i, e in enumerate(events) if e["call"] == "step"]
    for start, end in zip(starts, starts[1:] + [len(events)]):
        calls = [e for e in events[start + 1:end] if e["call"] not in ("regenerated",)]
        assert events[end - 1] == {"call": "regenerated", "value": 1.0}
        vllm_calls = [(e["call"], e["args"]) for e in calls if e["call"].startswith("vllm.")]
        assert vllm_calls == [("vllm.generate", []), ("vllm.sleep", []), ("vllm.wake_up", [["weights"]]),
                              ("vllm.load_weights", []), ("vllm.wake_up", [["kv_cache"]])], vllm_calls
        sleep_at = next(i for i, e in enumerate(calls) if e["call"] == "vllm.sleep")
        wake_at = next(i for i, e in enumerate(calls) if e["call"] == "vllm.wake_up")
        hf_calls = [i for i, e in enumerate(calls) if e["call"] == "hf.generate"]
        steps = [i for i, e in enumerate(calls) if e["call"] in ("actor.step", "critic.step")]
        assert len(hf_calls) == 1 and len(steps) == 4   # critic and actor, 2 mini-batches each
        for i in hf_calls + steps:
            assert sleep_at < i < wake_at and calls[i]["asleep"] == ["kv_cache", "weights"], calls[i]
        load = next(e for e in calls if e["call"] == "vllm.load_weights")
        assert load["asleep"] == ["kv_cache"]   # only the weights woken to receive them


# ----------------------------------------------------------------------------------------------
# 5. --dry_run counts the whole actor the hf engine gathers under ZeRO-3
def seven_b_plan(engine: str, zero_stage, gpu_gib: float):
    from plumbing import preflight
    llama7b = preflight.ModelShape(params=6_738_415_616, trainable=6_738_415_616, largest=131_072_000, hidden=4096,
                                   layers=32, heads=32, kv_width=4096, intermediate=11008, vocab=32000)
    return preflight.Plan(
        actor=llama7b, critic=None, ref=None, reward=None, worlds=[8], zero_stage=zero_stage, offload_optimizer=False,
        offload_params=False, ref_offload=False, reward_offload=False, bf16=False, micro_batch=1, critic_micro_batch=1,
        seq_len=1024, response_len=512, gen_batch=8, gradient_checkpointing=True, critic_gradient_checkpointing=True,
        engine=engine, gpu_memory_utilization=0.5, kv_cache_gb=1.0, gpu_bytes=int(gpu_gib * 2**30),
        host_bytes=2**40, local_ranks=8, baseline_bytes=0)


def test_dry_run_counts_the_actor_the_hf_engine_gathers_under_zero3(capsys):
    """A 7B fp32 actor on 8 ranks under ZeRO-3 holds about 3 GiB of weights per rank, but the hf
    engine's generation gathers all of it on every rank (about 25 GiB, the issue's 28 GB): with
    a 40 GiB GPU the preflight must say it does not fit and name that row; vLLM has no such row."""
    from plumbing import preflight
    rows = {what: b for what, b, _ in preflight.rows_for(seven_b_plan("hf", 3, 40), 8)}
    gathered = [what for what in rows if "gathered full actor" in what]
    assert len(gathered) == 1
    assert rows[gathered[0]] / 1e9 == pytest.approx(27.0, abs=0.1)   # 6.74e9 fp32 weights
    assert rows[gathered[0]] == pytest.approx(8 * rows["actor weights"])   # 8 shards of it, whole
    assert not preflight.report(seven_b_plan("hf", 3, 40))
    out = capsys.readouterr().out
    assert "does not fit" in out and any("gathered full actor" in ln for ln in out.splitlines() if ln.startswith("  - "))
    assert preflight.report(seven_b_plan("vllm", 3, 40))   # vLLM's own copy: the same run fits
    assert not [w for w, _, _ in preflight.rows_for(seven_b_plan("hf", 2, 40), 8) if "gathered full actor" in w]


# ----------------------------------------------------------------------------------------------
# 2. entropy_floor: judged on a measure the reaction does not move
@pytest.mark.slow
def test_entropy_reaction_stays_until_the_policy_recovers_and_resumes_in_the_same_state(tmp_path):
    """A forced collapse: the demo's entropy at temperature 1 (about 0.6) is under entropy_floor=1,
    so from step 2 the run samples at temperature 3, where actor/entropy (measured at the sampling
    temperature) is far above entropy_recover=1.5 at once. The policy has not changed, so the
    reaction must stay on: guard/entropy, at the configured temperature, stays below 1.5 (judged on
    actor/entropy the reaction flapped on, off, on). A run stopped after step 3 and resumed
    carries on in that state, exactly like the whole run."""
    react = ["--entropy_floor=1.0", "--entropy_floor_temperature=3.0", "--entropy_floor_coeff=0.01",
             "--entropy_recover=1.5", *FAST]
    whole = run1(tmp_path, f"--output_dir={tmp_path / 'whole'}", *react, "--total_training_steps=4")
    assert whole.returncode == 0, whole.stderr[-3000:]
    logged = records(tmp_path / "whole")
    assert [r["guard/entropy_reaction"] for r in logged] == [0.0, 1.0, 1.0, 1.0]
    assert [r["guard/temperature"] for r in logged] == [1.0, 3.0, 3.0, 3.0]
    assert [r["guard/entropy_coeff"] for r in logged] == [0.0, 0.01, 0.01, 0.01]
    for r in logged[1:]:   # what used to undo the reaction, and what judges it now
        assert r["actor/entropy"] > 1.5 > r["guard/entropy"]
    assert whole.stderr.count("< entropy_floor") == 1 and "> entropy_recover" not in whole.stderr

    split = tmp_path / "split"
    for steps in (3, 4):
        proc = run1(tmp_path, f"--output_dir={split}", *react, f"--total_training_steps={steps}", "--save_freq=3")
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    same = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rs]  # noqa: E731
    assert same(records(split)) == same(logged)


@pytest.mark.slow
def test_entropy_reaction_ends_when_the_policy_really_recovers_and_a_wrong_way_reaction_is_warned(tmp_path):
    """A strong entropy bonus as the reaction (entropy_floor_coeff=1 at a high learning rate) does
    raise the policy's own entropy: once guard/entropy is above entropy_recover the reaction ends.
    Its temperature 0.8 < 1.0 lowers entropy, which the run warns about at the start."""
    out = tmp_path / "out"
    proc = run1(tmp_path, f"--output_dir={out}", "--entropy_floor=1.0", "--entropy_recover=1.2",
                "--entropy_floor_temperature=0.8", "--entropy_floor_coeff=1.0", "--actor_lr=2e-3",
                "--total_training_steps=6", *FAST)   # recovered after 2 to 3 steps of the reaction (seen)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "entropy_floor_temperature=0.8 is below temperature=1" in proc.stderr
    logged = records(out)
    reaction = [r["guard/entropy_reaction"] for r in logged]
    assert reaction[:2] == [0.0, 1.0] and 0.0 in reaction[2:], reaction
    end = reaction.index(0.0, 2)          # the first step after the reaction ended
    assert all(r == 1.0 for r in reaction[1:end])
    assert logged[end - 1]["guard/entropy"] > 1.2   # judged recovered on the configured temperature's entropy
    assert all(r["guard/entropy"] <= 1.2 for r in logged[1:end - 1])
    assert logged[end]["guard/temperature"] == 1.0 and logged[end]["guard/entropy_coeff"] == 0.0


# ----------------------------------------------------------------------------------------------
# 4. rollout_fallback_hf when vLLM fails on one rank only
FIRST_FORWARD_FAILS_ON_RANK1 = """
import importlib.abc, importlib.util, os, sys
if os.environ.get("RANK") == "1":
    class _FailFirstForward(importlib.abc.MetaPathFinder):
        # once vLLM's LLM class loads on rank 1, its generate fails there, as an unsupported kernel
        # does at the first forward: after vLLM's own setup, whose collectives span both ranks (a
        # failure inside them hangs vLLM itself, whatever the trainer does)
        def find_spec(self, name, path, target=None):
            if name != "vllm.entrypoints.llm":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)

                def generate(llm, *args, **kwargs):
                    raise RuntimeError("no kernel for this attention head size on this rank's device")
                module.LLM.generate = generate
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _FailFirstForward())
"""


@pytest.mark.slow
def test_zero3_vllm_failing_on_one_rank_falls_back_on_every_rank(tmp_path):
    """vLLM starts on rank 0 but not on rank 1 (its first forward fails there), with
    rollout_fallback_hf: every rank must generate with the hf engine, so that the weight sync's
    ZeRO-3 gathers are run by all or none; setup must not hang, and the run trains to the end."""
    (tmp_path / "sitecustomize.py").write_text(FIRST_FORWARD_FAILS_ON_RANK1)
    out = tmp_path / "out"
    proc = launch2(tmp_path, f"--output_dir={out}", "--total_training_steps=2", "--rollout_engine=vllm",
                   "--rollout_fallback_hf=true", "--rollout_sync_bucket_mb=0.5", *RUN2,
                   env_extra={"PYTHONPATH": str(tmp_path)}, timeout=600)
    assert proc.returncode == 0, tail(proc)
    logged = records(out)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        assert all(math.isfinite(v) for v in r.values())
        # the hf engine reports its own sampler's log-probs: generation's and training's forward round apart
        assert r["rollout/logprob_diff"] < 1e-5
    assert "rollout engine hf" in proc.stdout   # rank 0's engine, in the header it prints
    assert "vLLM did not start, generating with the hf engine" in proc.stderr   # rank 1
    assert "rank 0: vLLM started here but not on every rank" in proc.stderr
