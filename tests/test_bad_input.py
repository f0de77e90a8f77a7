"""Everything a user can hand over wrong stops before training with one line that names the
culprit (key, file, line, row, value): each loader is checked at its own boundary, in process, and
two end-to-end runs check that the script prints that line and no traceback."""
import os
import sys
from pathlib import Path

import pandas as pd
import pytest

import forkserver
from distribution import plugins as distributed
import train_ppo
import config
from modeling import loading
from config import load_config
from errors import UserError
from prompts.sets import load_prompts, read_table

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "examples" / "demo_model"


def message(call) -> str:
    with pytest.raises(UserError) as e:
        call()
    text = str(e.value)
    assert "\n" not in text.strip() or text.count("\n") <= 1, text
    return text


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_lr: 1e-5\nrollout_n: [4\nseed: 1\n")
    text = message(lambda: load_config(["--config", str(bad)]))
    assert str(bad) in text and "not valid YAML" in text and "line" in text


def test_binary_config_file_is_named(tmp_path):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(bytes(range(256)))
    assert str(bad) in message(lambda: load_config(["--config", str(bad)]))


def test_malformed_json_line_is_named_by_number(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": "2+2=",\n{"prompt": "3+3="}\n')
    text = message(lambda: read_table(str(data)))
    assert str(data) in text and "line 2" in text


def test_json_line_that_is_not_an_object_is_named(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1="}\n["2+2="]\n')
    assert "line 2" in message(lambda: read_table(str(data)))


@pytest.mark.parametrize("name", ["p.jsonl", "p.parquet"])
def test_binary_data_file_is_named(tmp_path, name):
    data = tmp_path / name
    data.write_bytes(os.urandom(512) + b"\xff\xfe")
    text = message(lambda: read_table(str(data)))
    assert str(data) in text and "cannot be read" in text


def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def test_chat_messages_without_a_chat_template_name_the_row(tmp_path):
    tok = tokenizer()
    assert not getattr(tok, "chat_template", None)
    data = tmp_path / "chat.jsonl"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "1+1="}]]}).to_json(data, orient="records", lines=True)
    text = message(lambda: load_prompts(str(data), "prompt", tok, 16, "error"))
    assert str(data) in text and "row 0" in text and "chat template" in text


def test_model_directory_that_cannot_be_loaded_names_the_key(tmp_path):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    cfg = config.Config(model_path=str(broken))
    text = message(lambda: loading.load_models(cfg))
    assert "model_path" in text and str(broken) in text


def test_actor_whose_weights_hold_nan_is_refused_at_load(tmp_path):
    """A checkpoint with one NaN weight: load_models stops with one line naming the key, the path and
    the NaN, before anything is trained on NaN log-probs (the causality probe used to pass it)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")   # the final norm: every position's logits
    model.save_pretrained(tmp_path / "poisoned")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEMO_MODEL / name).exists():
            (tmp_path / "poisoned" / name).write_text((DEMO_MODEL / name).read_text())
    cfg = config.Config(model_path=str(tmp_path / "poisoned"), adv_estimator="grpo", use_kl_in_reward=False)
    text = message(lambda: loading.load_models(cfg))
    assert "model_path" in text and str(tmp_path / "poisoned") in text and "NaN" in text, text
    loading.load_models(config.Config(model_path=str(DEMO_MODEL), adv_estimator="grpo", use_kl_in_reward=False))


def test_reward_model_directory_without_weights_names_the_key(tmp_path):
    empty = tmp_path / "rm"
    empty.mkdir()
    (empty / "config.json").write_text((DEMO_MODEL / "config.json").read_text())
    cfg = config.Config(reward_model_path=str(empty), adv_estimator="grpo", use_kl_in_reward=False)
    text = message(lambda: loading.load_models(cfg))
    assert "reward_model_path" in text and str(empty) in text


@pytest.mark.parametrize("override, key", [
    ("--actor_lr=-0.5", "actor_lr"), ("--critic_lr=0", "critic_lr"), ("--weight_decay=-0.1", "weight_decay"),
    ("--top_k=0", "top_k"), ("--gamma=1.5", "gamma"), ("--lam=-0.1", "lam"), ("--max_grad_norm=0", "max_grad_norm"),
    ("--rollout_gpu_memory_utilization=1.5", "rollout_gpu_memory_utilization"), ("--kl_coef=-1", "kl_coef"),
])
def test_values_the_optimizer_or_sampler_would_refuse_are_named(override, key):
    text = message(lambda: load_config([override]))
    assert key in text and override.split("=")[1] in text


def test_registering_a_model_that_is_not_logged_is_refused():
    text = message(lambda: load_config(["--mlflow_registered_model_name=demo", "--mlflow_log_model=false"]))
    assert "mlflow_registered_model_name=demo" in text and "mlflow_log_model" in text


def run(tmp_path, *args):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    return forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), "--mlflow_log_model=false", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_output_dir_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run(tmp_path, f"--output_dir={blocker}/out", "--total_training_steps=1")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "output_dir" in line[0] and str(blocker) in line[0]


def test_unloadable_model_is_one_line_without_traceback(tmp_path):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    proc = run(tmp_path, f"--model_path={broken}", f"--output_dir={tmp_path}/out", "--total_training_steps=1")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "model_path" in line[0] and str(broken) in line[0]


@pytest.mark.parametrize("conf, named", [
    ({"zero_optimization": {"stage": 0}}, "stage=0"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto", "check_grad_overflow": False}},
     "check_grad_overflow"),
])
def test_deepspeed_settings_that_would_apply_a_nan_update_are_refused(conf, named):
    """DeepSpeed 0.19 skips a step whose gradients are NaN/inf under ZeRO 1-3, but applies it at
    stage 0 (fp32) or with bf16.check_grad_overflow off: such a config stops the run at start."""
    text = message(lambda: distributed.check_deepspeed_config(conf, {}, bf16=False))
    assert named in text
    distributed.check_deepspeed_config({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}, {},
                                       bf16=False)   # the repository's configs pass


def test_grpo_with_kl_in_the_reward_is_warned_about():
    """GRPO divides by each group's std: with KL in the reward, tied verifier scores become
    advantages of KL noise. The combination runs (verl allows it) but is named at start."""
    notes = config.config_warnings(config.Config(adv_estimator="grpo"))
    assert len(notes) == 1 and "use_kl_in_reward" in notes[0] and "configs/demo_grpo.yaml" in notes[0]
    assert config.config_warnings(config.Config(adv_estimator="grpo", use_kl_in_reward=False)) == []
    assert config.config_warnings(config.Config(adv_estimator="grpo", norm_adv_by_std_in_grpo=False)) == []
    assert config.config_warnings(load_config(["--config", str(Path(train_ppo.__file__).parent /
                                                                  "configs/demo_grpo.yaml")])) == []


@pytest.mark.parametrize("override, key", [("--rollout_is=token", "rollout_is"),
                                           ("--rollout_max_logprob_diff=0.01", "rollout_max_logprob_diff")])
def test_bypass_mode_refuses_what_needs_the_actor_pass_it_skips(override, key):
    """rollout_bypass_mode takes the sampler's log-probs as the old ones: there is no actor pass
    before the update for the rollout correction or the drift reaction to compare them with."""
    text = message(lambda: load_config(["--rollout_bypass_mode=true", override]))
    assert "rollout_bypass_mode" in text and key in text and override.split("=")[1] in text
    load_config([override])   # each alone is fine


def test_bypass_mode_under_a_top_p_cut_is_warned_about():
    """The sampler's log-probs under a cut are of the renormalised distribution; the update's
    are of the whole one, so PPO's ratio starts below 1: it runs (verl allows it) but is named."""
    notes = config.config_warnings(config.Config(rollout_bypass_mode=True, top_p=0.9))
    assert len(notes) == 1 and "top_p=0.9" in notes[0] and "ratio" in notes[0]
    assert config.config_warnings(config.Config(rollout_bypass_mode=True)) == []
    assert config.config_warnings(config.Config(top_p=0.9)) == []


def test_prompt_truncation_drop_leaves_long_rows_out_with_their_columns(tmp_path, capsys):
    """verl's filter_overlong_prompts: over-long prompts are left out (and counted), and the
    reward function's columns stay aligned with the prompts that remain."""
    data = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["1+1=", "123456789+987654321=", "2+2="], "ground_truth": ["2", "x", "4"]}).to_parquet(data)
    prompts = load_prompts(str(data), "prompt", tokenizer(), 8, "drop", columns=("ground_truth",))
    assert prompts.texts == ["1+1=", "2+2="] and prompts.columns["ground_truth"] == ["2", "4"]
    # the file is tokenized in one call: each kept row's ids are still its own prompt's, unpadded
    assert prompts.ids == [tokenizer()(text, add_special_tokens=False)["input_ids"] for text in prompts.texts]
    assert "1 of 3 prompts are longer than max_prompt_length=8" in capsys.readouterr().err
    only_long = tmp_path / "long.parquet"
    pd.DataFrame({"prompt": ["123456789+987654321="]}).to_parquet(only_long)
    assert "every prompt is longer" in message(lambda: load_prompts(str(only_long), "prompt", tokenizer(), 8, "drop"))


def test_warmup_as_a_ratio_of_the_run():
    """lr_warmup_steps_ratio=0.3 over 10 steps warms up like lr_warmup_steps=3."""
    import torch
    model = torch.nn.Linear(2, 2)
    ratio = loading.make_optimizer(model, 1.0, config.Config(lr_warmup_steps_ratio=0.3, total_training_steps=10))[1]
    steps = loading.make_optimizer(model, 1.0, config.Config(lr_warmup_steps=3, total_training_steps=10))[1]
    plain = loading.make_optimizer(model, 1.0, config.Config(total_training_steps=10))[1]
    factors = [[s.lr_lambdas[0](i) for i in range(5)] for s in (ratio, steps, plain)]
    assert factors[0] == factors[1] and factors[0] != factors[2]


def test_the_critic_warms_up_over_its_own_ratio():
    """critic_lr_warmup_steps_ratio (verl's critic.optim.lr_warmup_steps_ratio) sets the critic's
    schedule as prepare_models builds it; the actor keeps lr_warmup_steps_ratio."""
    import torch
    from accelerate import Accelerator

    from distribution.prepare import prepare_models
    cfg = config.Config(lr_warmup_steps_ratio=0.5, critic_lr_warmup_steps_ratio=0.2, total_training_steps=10)
    out = prepare_models(Accelerator(cpu=True), False, cfg, torch.nn.Linear(2, 2), torch.nn.Linear(2, 1), None, None)
    actor_sched, critic_sched = out[2], out[5]
    assert actor_sched.lr_lambdas[0](1) == 1 / 5 and critic_sched.lr_lambdas[0](1) == 1 / 2
    assert actor_sched.lr_lambdas[0](2) < 1 and critic_sched.lr_lambdas[0](2) == 1.0
