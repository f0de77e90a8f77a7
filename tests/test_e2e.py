"""End-to-end runs of train_ppo.py as a subprocess on the committed demo model (CPU).

They check outcomes: exit code, the metrics.jsonl contract, the MLflow run read back with
MlflowClient, final/ loading with transformers, and clear errors on bad input.
"""
import json
import math
import os
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import forkserver
import wandb_offline
from mlflow_store import sqlite_uri

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
DEMO_MODEL = ROOT / "examples" / "demo_model"

# small but complete: 2 mini-batches x 2 micro-batches x 2 epochs per step
FAST = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
        "--ppo_epochs=2"]

STEP_KEYS = [
    "reward/score_mean", "reward/score_std", "reward/accuracy", "kl/mean", "kl/coef",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
    "actor/grad_norm", "actor/lr", "actor/skipped_steps",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/explained_var", "critic/grad_norm",
    "rollout/response_len_mean", "rollout/truncated_frac",
    "time/step_s", "time/gen_s", "time/score_s", "time/forward_s", "time/update_s", "time/sync_s", "time/log_s",
    "perf/tokens_per_s",
]


def run(tmp_path, *args, env_extra=None, timeout=600):
    env = dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path), PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    # the final model goes to MLflow in the run that checks it (short_run) only: it takes seconds
    return forkserver.run([sys.executable, str(SCRIPT), "--mlflow_log_model=false", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("short")
    out = tmp / "out"
    proc = run(tmp, f"--output_dir={out}", "--total_training_steps=3", "--test_freq=2", "--use_kl_loss=true",
               "--rollout_is=token", "--log_prob_micro_batch_size_per_device=32", "--critic_gradient_checkpointing=true",
               "--peak_tflops=1", "--mlflow_log_model=true", "--save_freq=2", "--mlflow_registered_model_name=demo-ppo",
               "--wandb=true", *FAST, env_extra=wandb_offline.env(tmp))
    return tmp, out, proc


def test_short_run_writes_the_metrics_contract(short_run):
    tmp, out, proc = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert set(records[0]) == {"step", "val/score_mean", "val/accuracy"}   # validation before training
    for r in records[1:]:
        missing = [k for k in STEP_KEYS + ["actor/kl_loss"] if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        bad = {k: v for k, v in r.items() if not math.isfinite(v)}
        assert not bad, f"step {r['step']} has non-finite {bad}"
        for key in ("perf/mfu", "perf/mfu/actor", "perf/mfu/critic", "perf/mfu/update", "perf/mfu/gen",
                    "perf/mfu/forward"):   # a 2-core CPU is far below 1 TFLOPS
            assert 0 < r[key] < 1, (key, r[key])
        # the update phase holds both updates and more: it cannot beat the better of the two
        assert r["perf/mfu/update"] <= max(r["perf/mfu/actor"], r["perf/mfu/critic"]) * (1 + 1e-9)
    assert "val/accuracy" in records[2] and "val/accuracy" in records[3]   # test_freq=2 and the last step
    assert "val/accuracy" not in records[1]
    assert records[1]["kl/mean"] == pytest.approx(0.0, abs=1e-6)          # actor == ref before any update
    assert records[3]["kl/mean"] > 1e-4                                   # and no longer after updates
    for r in records[1:]:   # the phases account for the step
        phases = sum(v for k, v in r.items() if k.startswith("time/") and k not in ("time/step_s", "time/val_s"))
        assert phases == pytest.approx(r["time/step_s"], rel=0.05)


def test_short_run_mlflow_run_reads_back(short_run):
    from mlflow.tracking import MlflowClient
    tmp, out, proc = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("ppo").experiment_id])
    assert len(runs) == 1
    run_ = runs[0]
    assert run_.info.status == "FINISHED"
    assert run_.data.params["total_training_steps"] == "3"
    history = client.get_metric_history(run_.info.run_id, "reward/score_mean")
    assert sorted(m.step for m in history) == [1, 2, 3]
    logged = read_metrics(out)
    assert {m.step: m.value for m in history} == pytest.approx({r["step"]: r["reward/score_mean"] for r in logged[1:]})
    artifacts = {a.path for a in client.list_artifacts(run_.info.run_id)}
    assert {"config.yaml", "curves.png", "samples"} <= artifacts
    tags = run_.data.tags   # what ran, so runs can be compared across machines and versions
    assert tags["model_uri"].startswith("models:/")   # the final model, as an MLflow transformers model
    assert tags["world_size"] == "1" and tags["zero_stage"] == "none" and tags["rollout_engine"] == "hf"
    assert {"version.torch", "version.transformers", "version.deepspeed", "version.mlflow"} <= set(tags)


def test_short_run_wandb_offline_run_holds_what_metrics_jsonl_holds(short_run):
    """wandb=true (offline here): one W&B run, project mlflow_experiment and named as the MLflow run,
    the whole config, every step's metrics.jsonl record with the same values, the validation
    samples as a table on the steps that validated, finished with exit code 0; files under output_dir."""
    tmp, out, proc = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = wandb_offline.runs(out)
    got = wandb_offline.read(run_dir)
    assert got["run"]["project"] == "ppo" and got["run"]["display_name"] == "out"
    config = got["run"]["config"]["update"]
    assert config["total_training_steps"] == 3 and config["wandb"] is True and config["use_kl_loss"] is True
    logged = read_metrics(out)
    assert sorted(got["history"]) == [r["step"] for r in logged]
    for record in logged:
        values = {k: v for k, v in got["history"][record["step"]].items() if not k.startswith("val/samples")}
        assert values == {k: v for k, v in record.items() if k != "step"}, record["step"]
    tables = [step for step, item in got["history"].items() if item.get("val/samples._type") == "table-file"]
    assert tables == [0, 2, 3]   # before training, test_freq=2 and the last step
    table = json.loads((run_dir / "files" / got["history"][3]["val/samples.path"]).read_text())
    assert {"prompt", "response"} <= set(table["columns"]) and table["data"]
    assert got["exit_code"] == 0
    state = json.loads((out / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["wandb_run_id"] == got["run"]["run_id"]   # what a resume continues


def test_short_run_terminal_is_quiet_and_says_where_things_are(short_run):
    """No third-party notices that tell the user nothing; a header; at the end where the outputs
    are and the exact command that opens this run's MLflow store."""
    tmp, out, proc = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    for noise in ("LOAD REPORT", "Loading weights", "Setting accelerator to CPU", "INFO mlflow", "Writing model shards"):
        assert noise not in text, noise
    assert "rollout engine hf" in proc.stdout and "no DeepSpeed" in proc.stdout
    for path in ("metrics.jsonl", "curves.png", "final"):
        assert str(out / path) in proc.stdout
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp}/mlflow.db" in proc.stdout
    assert "val/accuracy" in proc.stdout


def test_short_run_final_model_loads(short_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp, out, proc = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), start.state_dict().values()))
    assert changed, "final/ holds the initial weights: training did not update the actor"
    ids = tok("12+34=", add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[-1] == model.config.vocab_size


def card_facts(out, records) -> list[str]:
    """What a card of this run must say, from the run's own outputs: base model, data hashes, the
    final validation figure, the command, the commit, a library version."""
    import hashlib
    from importlib.metadata import version

    import yaml

    from plumbing.model_card import git_commit
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    last_val = [r for r in records if "val/accuracy" in r][-1]
    return [cfg["model_path"], f"| `val/accuracy` | {last_val['val/accuracy']:.4g} |", f"--output_dir={out}",
            git_commit().split()[0], f"transformers {version('transformers')}",
            *(hashlib.sha256(open(f, "rb").read()).hexdigest() for f in (cfg["train_files"], cfg["val_files"]))]


def test_short_run_final_model_card_and_registered_version(short_run):
    """final/README.md and each checkpoint's carry the run's facts; with mlflow_registered_model_name
    the final model is a new version in MLflow's model registry, described by the same facts."""
    from huggingface_hub import ModelCard
    from mlflow.tracking import MlflowClient
    tmp, out, proc = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = card_facts(out, read_metrics(out))
    card = ModelCard.load(out / "final" / "README.md")
    assert card.data.base_model == str(DEMO_MODEL) and card.data.library_name == "transformers"
    missing = [f for f in facts if f not in card.text]
    assert not missing, missing
    assert "![learning curves](../curves.png)" in card.text and (out / "final" / "../curves.png").is_file()
    for step in (2, 3):   # save_freq=2 and the last step
        assert f"checkpoint at step {step}" in (out / "checkpoints" / f"step_{step}" / "README.md").read_text()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    (run_,) = client.search_runs([client.get_experiment_by_name("ppo").experiment_id])
    (registered,) = client.search_model_versions("name='demo-ppo'")
    assert registered.run_id == run_.info.run_id and run_.data.tags["registered_model"] == "demo-ppo/1"
    missing = [f for f in facts if f not in registered.description]
    assert not missing, missing


def test_unknown_key_is_named_before_any_model_loads(tmp_path):
    proc = run(tmp_path, "--clip_ratio_hgih=0.3")
    assert proc.returncode != 0
    assert "clip_ratio_hgih" in proc.stderr and "clip_ratio_high" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_prompt_column_names_file_and_columns(tmp_path):
    data = tmp_path / "q.jsonl"
    pd.DataFrame({"question": ["1+1=", "2+2="]}).to_json(data, orient="records", lines=True)
    proc = run(tmp_path, f"--train_files={data}", "--val_files=", f"--output_dir={tmp_path}/out")
    assert proc.returncode != 0
    assert str(data) in proc.stderr and "'prompt'" in proc.stderr and "question" in proc.stderr


@pytest.mark.slow
def test_reward_returning_nan_stops_naming_the_sample_and_keeps_earlier_steps(tmp_path):
    (tmp_path / "flaky_reward.py").write_text(textwrap.dedent("""
        CALLS = [0]
        def score(prompts, responses):
            CALLS[0] += 1
            out = [0.0] * len(prompts)
            if CALLS[0] == 2:          # the second training step
                out[3] = float("nan")
            return out
    """))
    out = tmp_path / "out"
    proc = run(tmp_path, "--reward_fn=flaky_reward:score", "--val_before_train=false", "--test_freq=-1",
               f"--output_dir={out}", "--total_training_steps=3", *FAST, env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "sample 3" in proc.stderr and "nan" in proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1]


# the shared vLLM run (conftest.vllm_run); test_resume resumes the same configuration (validation
# before training only: a shorter run validates at its last step, which the 3-step run does not)
VLLM_RUN = ["--rollout_engine=vllm", "--total_training_steps=3", "--test_freq=-1", "--save_freq=1",
            "--rollout_max_logprob_diff=0.01", "--rollout_is=sequence", *FAST]


@pytest.mark.slow
def test_vllm_engine_run_keeps_sampler_and_actor_in_sync(vllm_run):
    """rollout_engine=vllm: the sampler's log-probs must match the actor's recomputed ones at every
    step while the actor moves away from its start (a broken weight sync would make them drift)."""
    tmp_path, out, proc = vllm_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "computes this model" not in proc.stderr   # fresh weights: vLLM computes Qwen2 as transformers does
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert r["rollout/logprob_diff"] < 1e-3
        assert r["time/sync_s"] > 0
        assert "perf/mfu" not in r   # no peak_tflops, and a CPU's peak is not known
        assert r["rollout_is/weight_mean"] == pytest.approx(1.0, abs=1e-2)   # fp32 sampler == actor, up to rounding
    assert records[3]["kl/mean"] > 1e-4    # the actor did change, so the sync carried real updates
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("ppo").experiment_id])
    assert mlflow_run.info.status == "FINISHED" and "model_uri" not in mlflow_run.data.tags   # mlflow_log_model=false


@pytest.mark.slow
def test_bypass_mode_updates_as_the_recomputed_run_does(tmp_path):
    """rollout_bypass_mode (verl's bypass mode): the sampler's log-probs are the old ones and the
    actor's no-grad pass is skipped. The hf engine in fp32 samples with the actor itself, so its
    log-probs are the actor's up to rounding: the same seed gives the same samples and the same
    update as verl's default run, which recomputes them. actor/entropy and rollout/logprob_diff
    then come from the update's first epoch and mini-batch."""
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        proc = run(tmp_path, f"--output_dir={out}", "--total_training_steps=2", "--test_freq=-1",
                   "--val_before_train=false", f"--rollout_bypass_mode={mode}", *FAST)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = read_metrics(out)
    recomputed, bypass = runs["false"], runs["true"]
    assert [r["step"] for r in bypass] == [1, 2]
    for r in bypass:
        missing = [k for k in STEP_KEYS + ["rollout/logprob_diff"] if k not in r]
        assert not missing and all(math.isfinite(v) for v in r.values()), missing
        assert r["rollout/logprob_diff"] < 1e-5                  # sampler == actor up to fp32 rounding
    a, b = recomputed[0], bypass[0]   # step 1: the same weights sample the same responses
    assert (b["rollout/response_len_mean"], b["reward/score_mean"]) == (a["rollout/response_len_mean"],
                                                                        a["reward/score_mean"])
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss", "kl/mean"):   # (a clip fraction
        # could move by one token where another CPU rounds a ratio across the clip boundary)
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # measured over the first epoch, the second mini-batch one optimizer step on: about the old pass's
    assert b["actor/entropy"] == pytest.approx(a["actor/entropy"], rel=0.05)


@pytest.mark.slow
def test_sampler_drift_regenerates_the_step_on_policy(tmp_path):
    """rollout_on_drift=regenerate with a threshold below fp32 rounding: every step's vLLM samples
    count as drifted, so the weights are re-sent and the step is sampled again by the actor itself
    (its rollout-correction weights are then 1 up to fp32 rounding: the hf engine reports its own
    sampler's log-probs, from generation's cached forward); the run goes on instead of stopping."""
    out = tmp_path / "out"
    proc = run(tmp_path, f"--output_dir={out}", "--rollout_engine=vllm", "--total_training_steps=2", "--test_freq=-1",
               "--val_before_train=false", "--rollout_max_logprob_diff=1e-12", "--rollout_on_drift=regenerate",
               "--rollout_is=token", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert proc.stderr.count("step regenerated with the hf engine") == 2
    for r in records:
        assert r["rollout/regenerated"] == 1.0 and r["rollout/logprob_diff"] > 1e-12
        assert r["rollout_is/weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["rollout_is/weight_max"] == pytest.approx(1.0, abs=1e-5)


def check_adapter_cards(tmp_path, out, records):
    """PEFT's empty template replaced by the adapter's card, the merged model's card, and the
    adapter registered as a model version from its files."""
    from huggingface_hub import ModelCard
    from mlflow.tracking import MlflowClient
    facts = card_facts(out, records)
    adapter = ModelCard.load(out / "final" / "README.md")
    assert adapter.data.library_name == "peft" and "LoRA rank 8" in adapter.text
    for text in (adapter.text, (out / "final" / "merged" / "README.md").read_text()):
        missing = [f for f in facts if f not in text]
        assert not missing, missing
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (registered,) = client.search_model_versions("name='demo-lora'")
    assert registered.source.endswith("/final") and "LoRA rank 8" in registered.description


@pytest.mark.slow
def test_lora_actor_with_vllm_sync_and_adapter_disabled_reference(tmp_path):
    """LoRA: only adapters train; the reference is the base model with adapters off; vLLM gets the
    merged weights every step; final/ holds the adapter (and, on request, the merged model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    out = tmp_path / "out"
    proc = run(tmp_path, f"--output_dir={out}", "--lora_rank=8", "--use_kl_loss=true", "--lora_save_merged=true",
               "--rollout_engine=vllm", "--actor_lr=1e-3", "--total_training_steps=3", "--test_freq=3", *FAST,
               "--mlflow_log_model=true", "--mlflow_registered_model_name=demo-lora")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    check_adapter_cards(tmp_path, out, records)
    assert records[1]["kl/mean"] == pytest.approx(0.0, abs=1e-6)   # adapters start at zero: policy == base
    assert records[3]["kl/mean"] > 1e-3                             # the adapters moved the policy off the base
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in records[1:])   # merged weights reached vLLM
    assert (out / "final" / "adapter_config.json").is_file()
    assert not (out / "final" / "model.safetensors").exists()
    ids = torch.tensor([[8, 11, 14, 7, 12, 17]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DEMO_MODEL), out / "final")(ids).logits
    merged = AutoModelForCausalLM.from_pretrained(out / "final" / "merged")(ids).logits
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)(ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4)
    assert not torch.allclose(adapted, base, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_critic_free_estimators_train_without_a_critic(tmp_path, estimator):
    out = tmp_path / "out"
    proc = run(tmp_path, f"--output_dir={out}", f"--adv_estimator={estimator}", "--total_training_steps=2",
               "--test_freq=-1", "--val_before_train=false", "--loss_agg_mode=seq-mean-token-sum-norm",
               "--overlong_buffer_len=2", "--truncation_penalty=0.5", "--reward_clip=1", "--use_dynamic_bsz=true",
               "--ppo_max_token_len_per_device=64", "--lr_scheduler_type=cosine", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert not any(k.startswith("critic/") for k in r)          # no critic was built
        assert "actor/pg_loss" in r and all(math.isfinite(v) for v in r.values())
    assert records[1]["actor/lr"] < records[0]["actor/lr"]           # cosine decays


@pytest.mark.slow
def test_critic_warmup_holds_the_actor_back_as_verl_counts(tmp_path):
    """verl updates the actor once global_steps (from 1) >= critic_warmup: 2 skips step 1 only.
    actor/entropy is logged at step 1 all the same: verl measures it in the old-log-prob pass."""
    out = tmp_path / "out"
    proc = run(tmp_path, f"--output_dir={out}", "--critic_warmup=2", "--total_training_steps=2", "--test_freq=-1",
               "--val_before_train=false", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = read_metrics(out)
    assert "critic/vf_loss" in first and "actor/pg_loss" not in first
    assert "actor/pg_loss" in second
    assert first["actor/entropy"] > 0 and second["actor/entropy"] > 0


@pytest.mark.slow
def test_the_critic_trains_on_its_own_schedule(tmp_path):
    """critic_ppo_epochs / critic_ppo_mini_batch_size (verl's critic.ppo_*): the critic's update
    changes while the actor's, which runs on values computed before any update, does not."""
    steps = ["--total_training_steps=1", "--test_freq=-1", "--val_before_train=false", *FAST]
    same = run(tmp_path, f"--output_dir={tmp_path}/same", *steps)
    own = run(tmp_path, f"--output_dir={tmp_path}/own", "--critic_ppo_epochs=1", "--critic_ppo_mini_batch_size=16",
              "--critic_ppo_micro_batch_size_per_device=16", *steps)
    assert same.returncode == 0 and own.returncode == 0, same.stderr[-2000:] + own.stderr[-2000:]
    a, b = read_metrics(tmp_path / "same")[0], read_metrics(tmp_path / "own")[0]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "critic/explained_var"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert a["critic/vf_loss"] != pytest.approx(b["critic/vf_loss"], rel=1e-3)
