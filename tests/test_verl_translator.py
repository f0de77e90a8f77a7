"""scripts/verl_to_config.py: a verl ppo_trainer YAML and Hydra overrides -> this toolkit's YAML.

Checks the mapped values, that every verl key given is accounted for (carried, consumed, or listed as
not carried with its value), that targets are looked up in config.Config at run time, and that the
output loads through config.load_config. Expected values are written by hand.
Run from the repo root: python -m pytest tests/test_verl_translator.py -q
"""
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import config  # noqa: E402
import verl_to_config as v2c  # noqa: E402

VERL_YAML = """
data:
  train_files: {train}
  val_files: [{val}]
  prompt_key: prompt
  max_prompt_length: 512
  max_response_length: 256
  train_batch_size: 1024
  truncation: middle
actor_rollout_ref:
  model:
    path: {model}
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    ppo_mini_batch_size: 16
    ppo_micro_batch_size_per_gpu: 4
    ppo_epochs: 4
    clip_ratio: 0.2
    clip_ratio_high: 0.28
    clip_ratio_c: 3.0
    entropy_coeff: 0
    use_kl_loss: true
    kl_loss_coef: 0.001
    kl_loss_type: low_var_kl
    loss_agg_mode: seq-mean-token-mean
    grad_clip: 0.5
    optim:
      lr: 3e-6
      weight_decay: 0.01
  rollout:
    name: vllm
    n: 5
    temperature: 0.9
    top_k: 0
    tensor_model_parallel_size: 2
    prompt_length: ${{data.max_prompt_length}}
    val_kwargs:
      temperature: 0.6
      do_sample: false
critic:
  model:
    path: {model}
  optim:
    lr: 1e-5
    weight_decay: 0.0
  ppo_micro_batch_size_per_gpu: 8
  ppo_epochs: ${{oc.select:actor_rollout_ref.actor.ppo_epochs,1}}
  cliprange_value: 0.25
  grad_clip: 2.0
reward_model:
  enable: true
  model:
    path: {model}
algorithm:
  adv_estimator: gae
  gamma: 0.99
  lam: 0.9
  use_kl_in_reward: true
  kl_penalty: k2
  kl_ctrl:
    type: adaptive
    kl_coef: 0.002
    target_kl: 0.05
    horizon: 5000
trainer:
  project_name: gsm8k_ppo
  experiment_name: run1
  default_local_dir: {out}/${{trainer.project_name}}/${{trainer.experiment_name}}
  logger: [console, wandb]
  n_gpus_per_node: 8
  test_freq: 5
  critic_warmup: 2
  val_before_train: false
  total_epochs: 3
  total_training_steps: null
"""

OVERRIDES = [
    "data.train_batch_size=32",                          # overrides the YAML's 1024
    "actor_rollout_ref.actor.optim.lr=1e-6",             # Hydra reads 1e-6 as a float
    "algorithm.kl_ctrl.kl_coef=0.001",
    "+data.some_new_knob=7",                             # unknown to the toolkit
    "~actor_rollout_ref.actor.clip_ratio_high",          # deleted: must not appear anywhere
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
]


@pytest.fixture
def workspace(tmp_path):
    """A model dir and 100-row train / 10-row val parquet files, so the output can load."""
    model = tmp_path / "model"
    model.mkdir()
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pd.DataFrame({"prompt": [f"{i}+1=" for i in range(100)]}).to_parquet(train)
    pd.DataFrame({"prompt": [f"{i}+2=" for i in range(10)]}).to_parquet(val)
    verl = tmp_path / "verl.yaml"
    verl.write_text(VERL_YAML.format(train=train, val=val, model=model, out=tmp_path / "ckpt"))
    return tmp_path, verl


def run(workspace, capsys, *extra):
    tmp, verl = workspace
    out = tmp / "toolkit.yaml"
    v2c.main(["--verl_config", str(verl), "-o", str(out), *OVERRIDES, *extra])
    return out, capsys.readouterr().err


def test_mapped_values(workspace, capsys):
    tmp, _ = workspace
    out, _ = run(workspace, capsys)
    cfg = yaml.safe_load(out.read_text())
    assert cfg["train_files"] == str(tmp / "train.parquet")
    assert cfg["val_files"] == str(tmp / "val.parquet")          # a one-element list
    assert cfg["model_path"] == cfg["critic_model_path"] == cfg["reward_model_path"] == str(tmp / "model")
    assert (cfg["max_prompt_length"], cfg["max_response_length"], cfg["prompt_key"]) == (512, 256, "prompt")
    assert cfg["train_batch_size"] == 32
    assert (cfg["actor_lr"], cfg["critic_lr"], cfg["weight_decay"]) == (1e-6, 1e-5, 0.01)
    assert (cfg["ppo_mini_batch_size"], cfg["ppo_micro_batch_size_per_device"], cfg["ppo_epochs"]) == (16, 4, 4)
    # the critic's own schedule (its epochs interpolate the actor's)
    assert (cfg["critic_ppo_micro_batch_size_per_device"], cfg["critic_ppo_epochs"]) == (8, 4)
    assert "critic_ppo_mini_batch_size" not in cfg
    assert (cfg["clip_ratio"], cfg["clip_ratio_c"], cfg["entropy_coeff"]) == (0.2, 3.0, 0.0)
    assert "clip_ratio_high" not in cfg
    assert (cfg["use_kl_loss"], cfg["kl_loss_coef"], cfg["kl_loss_type"]) == (True, 0.001, "low_var_kl")
    assert cfg["loss_agg_mode"] == "seq-mean-token-mean"
    assert (cfg["max_grad_norm"], cfg["critic_max_grad_norm"], cfg["cliprange_value"]) == (0.5, 2.0, 0.25)
    assert (cfg["rollout_engine"], cfg["rollout_n"], cfg["temperature"], cfg["top_k"]) == ("vllm", 5, 0.9, -1)
    assert cfg["val_temperature"] == 0.0                          # do_sample: false wins over temperature 0.6
    assert (cfg["adv_estimator"], cfg["gamma"], cfg["lam"]) == ("gae", 0.99, 0.9)
    assert (cfg["use_kl_in_reward"], cfg["kl_penalty"], cfg["kl_ctrl_type"]) == (True, "k2", "adaptive")
    assert (cfg["kl_coef"], cfg["target_kl"], cfg["kl_horizon"]) == (0.001, 0.05, 5000)
    assert cfg["output_dir"] == str(tmp / "ckpt" / "gsm8k_ppo" / "run1")
    assert (cfg["mlflow_experiment"], cfg["run_name"]) == ("gsm8k_ppo", "run1")   # W&B's project and name too
    assert cfg["wandb"] is True                                    # logger: [console, wandb]
    assert (cfg["test_freq"], cfg["critic_warmup"], cfg["val_before_train"]) == (5, 2, False)
    # the epochs are carried, the steps counted at setup (never written into the config)
    assert cfg["total_epochs"] == 3 and "total_training_steps" not in cfg
    assert cfg["rollout_tensor_model_parallel_size"] == 2
    assert cfg["log_prob_micro_batch_size_per_device"] == 16


def test_unmapped_keys_are_listed_with_their_values(workspace, capsys):
    out, err = run(workspace, capsys)
    not_carried = err[err.index("NOT carried"):]
    for line in ["data.truncation = middle",
                 "actor_rollout_ref.actor._target_ = verl.workers.config.FSDPActorConfig",
                 "actor_rollout_ref.rollout.val_kwargs.temperature = 0.6",
                 "critic.optim.weight_decay = 0.0",             # conflicts with the actor's 0.01
                 "data.some_new_knob = 7"]:
        assert line in not_carried, line
    assert "conflicts with actor_rollout_ref.actor.optim.weight_decay" in not_carried
    assert "clip_ratio_high" not in err
    assert "trainer.logger" not in not_carried                   # [console, wandb] is carried: wandb=true
    # the same list stays in the output file, as comments
    text = out.read_text()
    assert "#   data.truncation: middle  #" in text
    # the GPU count goes to the launch line
    assert "# Launch: accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 train_ppo.py" in text
    assert "trainer.n_gpus_per_node" not in not_carried
    assert "#   data.some_new_knob: 7  #" in text


def test_every_given_key_is_accounted_for_once(workspace):
    tmp, verl = workspace
    flat = v2c.resolve(v2c.read_verl([str(verl)], OVERRIDES))
    t = v2c.translate(flat)
    sources = [source for _, source, _ in t.carried.values()]
    used = [key for key, _, _ in t.used]
    dropped = [key for key, _, _ in t.not_carried]
    assert sorted(sources + used + dropped) == sorted(flat)


def test_output_loads_through_train_ppo(workspace, capsys):
    out, _ = run(workspace, capsys)
    cfg = config.load_config(["--config", str(out)])
    assert cfg.actor_lr == 1e-6 and cfg.kl_ctrl_type == "adaptive" and cfg.total_epochs == 3
    assert config.total_steps(cfg, 100) == 9                      # verl's count: 3 epochs x (100 rows // 32)
    assert cfg.reward_model_path.endswith("model")


def test_overrides_alone_and_yaml_style_values():
    flat = v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.actor.optim.lr=5e-7", "data.train_files=['a.parquet','b.parquet']",
        "trainer.val_before_train=False", "actor_rollout_ref.rollout.name=sglang", "trainer.total_training_steps=null"]))
    t = v2c.translate(flat)
    assert t.carried["actor_lr"][0] == 5e-7
    assert t.carried["train_files"][0] == "a.parquet,b.parquet"
    assert t.carried["val_before_train"][0] is False
    reasons = {key: why for key, _, why in t.not_carried}
    assert "vllm" in reasons["actor_rollout_ref.rollout.name"]      # sglang: not an engine here
    assert "null" in reasons["trainer.total_training_steps"]


def test_reward_model_path_needs_enable():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["reward_model.model.path=/rm"])))
    assert "reward_model_path" not in t.carried
    assert [key for key, _, _ in t.not_carried] == ["reward_model.model.path"]


def test_unresolved_interpolation_is_not_carried():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.default_local_dir=${oc.env:HOME}/ckpt"])))
    assert "output_dir" not in t.carried
    assert t.not_carried[0][0] == "trainer.default_local_dir"


def _config_class(add: dict = (), drop: tuple = ()):
    """config.Config with fields added or removed, as the toolkit may look later (or did before)."""
    hints = typing.get_type_hints(config.Config)
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                        metadata=f.metadata))
              for f in dataclasses.fields(config.Config) if f.name not in drop]
    fields += [(name, type(default), dataclasses.field(default=default)) for name, default in dict(add).items()
               if name not in hints]
    return dataclasses.make_dataclass("Config", fields)


def test_targets_are_looked_up_in_config_at_run_time(monkeypatch):
    flat = v2c.resolve(v2c.read_verl([], ["trainer.save_freq=10", "actor_rollout_ref.model.lora_rank=16"]))

    monkeypatch.setattr(config, "Config", _config_class(drop=("save_freq", "lora_rank")))
    t = v2c.translate(flat)
    assert t.carried == {}
    assert {key: why for key, _, why in t.not_carried} == {
        "trainer.save_freq": "the toolkit has no 'save_freq' key (yet)",
        "actor_rollout_ref.model.lora_rank": "the toolkit has no 'lora_rank' key (yet)"}

    monkeypatch.setattr(config, "Config", _config_class(add={"save_freq": -1, "lora_rank": 0}))
    t = v2c.translate(flat)
    assert t.carried["save_freq"][0] == 10 and t.carried["lora_rank"][0] == 16
    assert t.not_carried == []


def test_resume_and_checkpoint_keys(monkeypatch):
    monkeypatch.setattr(config, "Config", _config_class(add={"resume": "auto", "save_total_limit": 2}))
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.resume_mode=disable", "trainer.max_actor_ckpt_to_keep=3",
                                                     "trainer.max_critic_ckpt_to_keep=5"])))
    assert t.carried["resume"][0] == "never" and t.carried["save_total_limit"][0] == 3
    assert [key for key, _, _ in t.not_carried] == ["trainer.max_critic_ckpt_to_keep"]   # one limit here
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.resume_mode=resume_path",
                                                     "trainer.resume_from_path=/ckpt/global_step_5"])))
    assert "resume" not in t.carried and len(t.not_carried) == 2


def test_bad_value_types_are_not_carried():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["data.train_batch_size=lots", "algorithm.gamma=0.99"])))
    assert "train_batch_size" not in t.carried and t.carried["gamma"][0] == 0.99
    assert t.not_carried[0][0] == "data.train_batch_size" and "int" in t.not_carried[0][2]


def test_a_bad_override_is_an_error():
    with pytest.raises(SystemExit):
        v2c.read_verl([], ["data.train_batch_size"])


@pytest.mark.parametrize("override, key, value", [
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.4", "rollout_gpu_memory_utilization", 0.4),
    ("actor_rollout_ref.rollout.enforce_eager=True", "rollout_enforce_eager", True),
    ("actor_rollout_ref.rollout.free_cache_engine=False", "rollout_sleep", False),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", "log_prob_micro_batch_size_per_device", 32),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32", "ref_log_prob_micro_batch_size_per_device", 32),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=True", "gradient_checkpointing", True),
    ("critic.model.enable_gradient_checkpointing=True", "critic_gradient_checkpointing", True),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "lr_warmup_steps_ratio", 0.1),
    ("critic.optim.lr_warmup_steps_ratio=0.1", "critic_lr_warmup_steps_ratio", 0.1),
    ("trainer.log_system_metrics=True", "mlflow_system_metrics", True),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "min_lr_ratio", 0.1),
    ("data.filter_overlong_prompts=True", "prompt_truncation", "drop"),
    ("trainer.log_val_generations=10", "log_samples", 10),
    ("actor_rollout_ref.rollout.val_kwargs.top_p=0.9", "top_p", 0.9),
    ("algorithm.filter_groups.enable=True", "filter_groups_enable", True),
    ("algorithm.filter_groups.metric=acc", "filter_groups_metric", "acc"),
    ("algorithm.filter_groups.metric=seq_final_reward", "filter_groups_metric", "seq_final_reward"),
    ("algorithm.filter_groups.max_num_gen_batches=10", "max_num_gen_batches", 10),
    ("algorithm.filter_groups.max_num_gen_batches=-1", "max_num_gen_batches", 0),   # verl: <= 0 is no limit
    ("actor_rollout_ref.rollout.max_num_batched_tokens=8192", "rollout_max_num_batched_tokens", 8192),
    ("actor_rollout_ref.rollout.max_num_seqs=256", "rollout_max_num_seqs", 256),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=4", "rollout_tensor_model_parallel_size", 4),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384", "log_prob_max_token_len_per_device", 16384),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384", "ref_log_prob_max_token_len_per_device", 16384),
    ("data.val_batch_size=1312", "val_batch_size", 1312),
    ("actor_rollout_ref.model.enable_activation_offload=True", "activation_offload", True),
    ("critic.model.enable_activation_offload=True", "activation_offload", True),
    ("algorithm.use_pf_ppo=True", "use_pf_ppo", True),
    ("algorithm.pf_ppo.reweight_method=max_random", "pf_ppo_reweight_method", "max_random"),
    ("algorithm.pf_ppo.weight_pow=1.5", "pf_ppo_weight_pow", 1.5),
    ("trainer.total_epochs=15", "total_epochs", 15),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size", 2),
    ("critic.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size", 2),
    ("algorithm.rollout_correction.bypass_mode=True", "rollout_bypass_mode", True),
    ("algorithm.rollout_correction.rollout_is=sequence", "rollout_is", "sequence"),
    ("algorithm.rollout_correction.rollout_is=null", "rollout_is", "off"),
    ("algorithm.rollout_correction.rollout_is_threshold=3.0", "rollout_is_threshold", 3.0),
])
def test_each_added_mapping(override, key, value):
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [override])))
    assert t.carried[key][:2] == (value, override.split("=")[0]) and not t.not_carried


def test_verl_dapo_recipe_keys_carry_and_a_metric_without_a_counterpart_is_named():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=512"])))
    assert {k: v[0] for k, v in t.carried.items()} == {
        "filter_groups_enable": True, "filter_groups_metric": "acc", "max_num_gen_batches": 10,
        "clip_ratio_high": 0.28, "overlong_buffer_len": 512}
    for metric in ("null", "pass@4"):
        other = v2c.translate(v2c.resolve(v2c.read_verl([], [f"algorithm.filter_groups.metric={metric}"])))
        assert not other.carried and "seq_reward" in other.not_carried[0][2]


def test_global_micro_batches_are_divided_by_the_gpus_as_verl_does():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.actor.ppo_micro_batch_size=128", "critic.ppo_micro_batch_size=256",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=256", "trainer.n_gpus_per_node=8"])))
    assert t.carried["ppo_micro_batch_size_per_device"][0] == 16
    assert t.carried["critic_ppo_micro_batch_size_per_device"][0] == 32
    assert t.carried["log_prob_micro_batch_size_per_device"][0] == 32
    alone = v2c.translate(v2c.resolve(v2c.read_verl([], ["actor_rollout_ref.actor.ppo_micro_batch_size=128"])))
    assert "n_gpus_per_node" in alone.not_carried[0][2]          # cannot divide without the GPU count


def test_settings_that_are_already_the_toolkits_behaviour_are_consumed():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=False",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False", "trainer.use_legacy_worker_impl=auto",
        "data.filter_overlong_prompts=True", "data.truncation=error", "trainer.logger=[console]"])))
    assert not t.not_carried
    assert {key for key, _, _ in t.used} == {
        "actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding",
        "actor_rollout_ref.actor.fsdp_config.param_offload", "trainer.use_legacy_worker_impl",
        "data.truncation", "trainer.logger"}
    other = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", "trainer.logger=[console,tensorboard]"])))
    assert len(other.not_carried) == 2


@pytest.mark.parametrize("loggers, wandb, not_carried", [
    ("[console,wandb]", True, []),
    ("['console','mlflow']", None, []),
    ("[console,wandb,tensorboard,swanlab]", True, ["tensorboard", "swanlab"]),
    ("[clearml]", None, ["clearml"]),
])
def test_trainer_logger_wandb_switches_wandb_on_and_other_loggers_are_named(loggers, wandb, not_carried):
    """verl's trainer.logger: wandb -> wandb=true, console and mlflow are always on, any other
    logger is not carried, by name; trainer.project_name and experiment_name name the runs."""
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [f"trainer.logger={loggers}", "trainer.project_name=p",
                                                     "trainer.experiment_name=e"])))
    assert t.carried.get("wandb", (None,))[0] is wandb
    assert (t.carried["mlflow_experiment"][0], t.carried["run_name"][0]) == ("p", "e")
    (why,) = [why for key, _, why in t.not_carried if key == "trainer.logger"] or [""]
    assert all(name in why for name in not_carried) and bool(why) == bool(not_carried)
    if wandb:
        assert "wandb: true  # trainer.logger" in v2c.to_yaml(t, "test")


def test_total_epochs_is_moot_when_the_steps_are_given():
    """verl runs trainer.total_training_steps when it is set, whatever total_epochs says; a null one
    leaves the count to the epochs (the toolkit counts them at setup)."""
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.total_training_steps=2", "trainer.total_epochs=15"])))
    assert t.carried["total_training_steps"][0] == 2 and "total_epochs" not in t.carried
    assert [key for key, _, _ in t.used] == ["trainer.total_epochs"] and not t.not_carried
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.total_training_steps=null", "trainer.total_epochs=15"])))
    assert t.carried["total_epochs"][0] == 15 and "total_training_steps" not in t.carried and not t.not_carried


def test_gpus_and_nodes_make_the_launch_line():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.n_gpus_per_node=8", "trainer.nnodes=2"])))
    assert t.launch.startswith("accelerate launch") and "--num_processes 16 --num_machines 2" in t.launch
    assert {key for key, _, _ in t.used} == {"trainer.n_gpus_per_node", "trainer.nnodes"}
    one = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.n_gpus_per_node=1"])))
    assert one.launch == "python train_ppo.py --config THIS_FILE"
    bad = v2c.translate(v2c.resolve(v2c.read_verl([], ["trainer.n_gpus_per_node=auto"])))
    assert bad.launch == "" and [key for key, _, _ in bad.not_carried] == ["trainer.n_gpus_per_node"]


def test_the_reward_loop_keys_carry_where_they_mean_the_same():
    """verl's reward loop serving a reward model on vLLM: rollout.name and its memory share carry
    (with reward_model.enable, as the model path does); the other reward-loop keys are named with
    their reason."""
    keys = ["reward_model.enable=True", "reward_model.model.path=/m/rm", "reward_model.use_reward_loop=True",
            "reward_model.rollout.name=vllm", "reward_model.rollout.gpu_memory_utilization=0.3",
            "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=2048",
            "reward_model.rollout.response_length=1024", "reward_model.num_workers=8"]
    t = v2c.translate(v2c.resolve(v2c.read_verl([], keys)))
    assert t.carried["reward_model_engine"][0] == "vllm"
    assert t.carried["reward_model_gpu_memory_utilization"][0] == 0.3
    assert {key for key, _, _ in t.not_carried} == {"reward_model.rollout.prompt_length",
                                                     "reward_model.rollout.response_length",
                                                     "reward_model.num_workers"}
    reasons = {key: why for key, _, why in t.not_carried}
    assert "reward_judge_prompt_length" in reasons["reward_model.rollout.prompt_length"]
    assert "no reward workers" in reasons["reward_model.num_workers"]
    assert {"reward_model.use_reward_loop", "reward_model.rollout.tensor_model_parallel_size"} <= \
        {key for key, _, _ in t.used}

    # without reward_model.enable, verl serves no reward model: nothing carried that would not act
    off = v2c.translate(v2c.resolve(v2c.read_verl([], ["reward_model.rollout.name=vllm"])))
    assert not off.carried and "reward_model.enable=true" in off.not_carried[0][2]
    other = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "reward_model.enable=True", "reward_model.rollout.name=sglang", "reward_model.rollout.tensor_model_parallel_size=2"])))
    assert "reward_model_engine" not in other.carried
    assert {key for key, _, _ in other.not_carried} == {"reward_model.rollout.name",
                                                         "reward_model.rollout.tensor_model_parallel_size"}


SCRIPTS = sorted((ROOT / "tests" / "data" / "verl_scripts").glob("*.txt"))


def _published(script: Path):
    """One of verl's published PPO scripts: (its settings, their translation). The file holds the
    overrides of the script's main_ppo command as verl_launch_script.py read them (its header names the
    script and the verl commit)."""
    overrides = [ln.strip() for ln in script.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    flat = v2c.resolve(v2c.read_verl([], overrides))
    return flat, v2c.translate(flat)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_verl_published_ppo_scripts_are_mostly_carried(script):
    """verl's own PPO launch scripts: at least 85% of each one's keys are carried or already the
    toolkit's behaviour, and each one that is not says why in specific terms."""
    flat, t = _published(script)
    assert (len(flat) - len(t.not_carried)) / len(flat) >= 0.85, t.not_carried
    assert all(why != "no counterpart in the toolkit" for _, _, why in t.not_carried), t.not_carried


def test_verl_published_ppo_scripts_carried_together(capsys):
    """Over the 18 FSDP scripts of verl's examples/ppo_trainer together, by count: 98.0% (745 of 760).
    What is left, by count: the served reward model's reward-loop sizes (6), and 9 others (one a
    trainer.logger that the script's reading split at a space); printed below."""
    given, missing = 0, []
    for script in SCRIPTS:
        flat, t = _published(script)
        given += len(flat)
        missing += [(script.stem, key, why) for key, _, why in t.not_carried]
    with capsys.disabled():
        print(f"\nverl PPO scripts: {given - len(missing)}/{given} carried or consumed; not carried:")
        for script, key, why in missing:
            print(f"  {script}: {key} ({why})")
    assert len(SCRIPTS) == 18 and (given - len(missing)) / given >= 0.98, (given, len(missing))


def test_ulysses_sizes_must_agree_the_toolkit_has_one():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=4"])))
    assert t.carried["ulysses_sequence_parallel_size"][:2] == (2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    assert [k for k, _, why in t.not_carried if "conflicts" in why] == ["critic.ulysses_sequence_parallel_size"]


def test_a_rollout_correction_level_the_toolkit_lacks_is_not_carried():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["algorithm.rollout_correction.rollout_is=geometric"])))
    assert "rollout_is" not in t.carried
    (why,) = [reason for key, _, reason in t.not_carried if key == "algorithm.rollout_correction.rollout_is"]
    assert "token or sequence" in why


def test_bypass_mode_leaves_verls_metrics_only_rollout_is_behind():
    """verl's bypass mode with its default ppo_clip loss computes rollout_is weights for metrics
    only; the toolkit refuses rollout_is with bypass mode, so it is not carried (with the reason)."""
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["algorithm.rollout_correction.bypass_mode=True",
                                                     "algorithm.rollout_correction.rollout_is=token",
                                                     "algorithm.rollout_correction.rollout_is_threshold=3.0"])))
    assert t.carried["rollout_bypass_mode"][0] is True
    assert "rollout_is" not in t.carried and "rollout_is_threshold" not in t.carried
    reasons = [reason for key, _, reason in t.not_carried if key.startswith("algorithm.rollout_correction.rollout_is")]
    assert len(reasons) == 2 and all("bypass_mode" in why for why in reasons)
    config.validate_config(config.Config(**{k: v[0] for k, v in t.carried.items()}))   # it loads


def test_chat_template_kwargs_are_gathered_into_one_mapping(tmp_path):
    """verl's data.apply_chat_template_kwargs, given leaf by leaf or whole, is chat_template_kwargs; the
    written YAML loads through config.load_config with the same mapping."""
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["+data.apply_chat_template_kwargs.enable_thinking=false",
                                                     "+data.apply_chat_template_kwargs.extra.depth=2"])))
    assert t.carried["chat_template_kwargs"][:2] == ({"enable_thinking": False, "extra": {"depth": 2}},
                                                     "data.apply_chat_template_kwargs")
    assert not t.not_carried and not t.used
    whole = v2c.translate(v2c.resolve(v2c.read_verl([], ["+data.apply_chat_template_kwargs={enable_thinking: true}"])))
    assert whole.carried["chat_template_kwargs"][0] == {"enable_thinking": True}
    out = tmp_path / "mine.yaml"
    out.write_text(v2c.to_yaml(t, "test"))
    assert config.load_config(["--config", str(out)]).chat_template_kwargs == {"enable_thinking": False,
                                                                                "extra": {"depth": 2}}


# ---- launch scripts ---------------------------------------------------------------------------
# Written here in the shapes verl's example scripts take: variables set before the command (quoted
# lists of paths, HOME from the environment), a prefix before python3, continuations with and
# without a space before the backslash, $@, and the output piped to tee.
LAUNCH = r"""set -x
# data
export DATA=$HOME/data   # the environment's HOME
train_files="['$DATA/train.parquet']"
MODEL=${MODEL_DIR:-$HOME/model}
EXP=run1
EXTRA=(
    "trainer.experiment_name=$EXP"
    trainer.test_freq=5
)
huggingface-cli download some/model --local-dir $MODEL &
wait

PYTHONUNBUFFERED=1 nsys profile python3 -m verl.trainer.main_ppo --config-name='ppo_trainer' \
    algorithm.adv_estimator=gae \
    data.train_files="$train_files" \
    data.truncation='error' \
    actor_rollout_ref.model.path=$MODEL\
    actor_rollout_ref.actor.optim.lr=1e-6 \
    trainer.logger=['console'] \
    "${EXTRA[@]}" \
    trainer.total_epochs=${EPOCHS:-"3"} $@ 2>&1 | tee verl_demo.log

python3 -m verl.trainer.main_ppo trainer.total_epochs=99
"""


def test_a_launch_script_is_read_as_bash_runs_it(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(LAUNCH)
    read = v2c.read_launch_script(str(script), {"HOME": "/h"})
    assert read.overrides == [
        "algorithm.adv_estimator=gae", "data.train_files=['/h/data/train.parquet']", "data.truncation=error",
        "actor_rollout_ref.model.path=/h/model", "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.logger=[console]", "trainer.experiment_name=run1", "trainer.test_freq=5", "trainer.total_epochs=3"]
    assert read.unresolved == [] and read.line == 14
    notes = " | ".join(read.notes)
    assert "main_ppo 2 times (lines 14, 24); translated the first" in notes
    assert "--config-name=ppo_trainer" in notes and "($@)" in notes
    # the environment gives what the script leaves to it
    read = v2c.read_launch_script(str(script), {"HOME": "/h", "MODEL_DIR": "/models/m", "EPOCHS": "7"})
    assert "actor_rollout_ref.model.path=/models/m" in read.overrides and read.overrides[-1] == "trainer.total_epochs=7"


# bash itself, with python3, nsys and huggingface-cli as functions: python3 writes the arguments of
# the first main_ppo command it is given, one a line
_RECORDER = r"""python3() { if [ "$1" = -m ] && [ "$2" = verl.trainer.main_ppo ]; then shift 2;
  [ -e "$ARGS" ] || printf '%s\n' "$@" > "$ARGS"; fi; }
nsys() { shift; "$@"; }
huggingface-cli() { :; }
"""


@pytest.mark.parametrize("env", [{}, {"MODEL_DIR": "/models/m", "EPOCHS": "7"}])
def test_the_reader_agrees_with_bash(tmp_path, env):
    """The overrides read from the script are the words bash passes to main_ppo (its options aside)."""
    script, args = tmp_path / "run.sh", tmp_path / "args.txt"
    script.write_text(LAUNCH)
    environ = {"HOME": "/h", "PATH": os.environ["PATH"], **env}
    subprocess.run(["bash", "-c", _RECORDER + 'source "$0"', str(script)], cwd=tmp_path, check=True,
                   env={**environ, "ARGS": str(args)}, capture_output=True)
    words = [w for w in args.read_text().split("\n")[:-1] if not w.startswith("--")]
    assert v2c.read_launch_script(str(script), environ).overrides == words


def test_a_launch_script_translates_and_loads(workspace, capsys, monkeypatch):
    """The script's overrides, then those given after it (where its $@ puts them): the YAML written
    loads through config.load_config."""
    tmp, _ = workspace
    monkeypatch.setenv("HOME", str(tmp))
    (tmp / "data").mkdir()
    (tmp / "train.parquet").rename(tmp / "data" / "train.parquet")
    script, out = tmp / "run.sh", tmp / "mine.yaml"
    script.write_text(LAUNCH)
    v2c.main([str(script), "-o", str(out), "actor_rollout_ref.actor.optim.lr=2e-6"])
    err = capsys.readouterr().err
    cfg = yaml.safe_load(out.read_text())
    assert cfg["train_files"] == str(tmp / "data" / "train.parquet") and cfg["model_path"] == str(tmp / "model")
    assert (cfg["actor_lr"], cfg["total_epochs"], cfg["run_name"], cfg["test_freq"]) == (2e-6, 3, "run1", 5)
    assert "# Note: read the main_ppo command at line 14 of" in out.read_text()
    assert "main_ppo 2 times" in err and "NOT carried (0)" in err
    loaded = config.load_config(["--config", str(out), "--val_files", "", "--reward_fn", "rewards.gsm8k:compute_score"])
    assert loaded.actor_lr == 2e-6 and loaded.total_epochs == 3


def test_an_unresolved_variable_is_named_and_not_carried(tmp_path, capsys):
    """$UNSET and $(command): the override is listed as not carried with the reference, never
    carried as a literal '$UNSET'; an earlier value of the same key is not carried either (verl
    would have used the later one)."""
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.train_batch_size=64 \\\n"
                      "    data.train_batch_size=$BATCH trainer.experiment_name=exp_$(date +%m%d) \\\n"
                      "    trainer.project_name=${PROJECT} algorithm.gamma=0.99\n")
    t = v2c.translate_sources([], str(script), [], env={})
    assert {k: v[0] for k, v in t.carried.items()} == {"gamma": 0.99}
    assert [(key, value, why.split(":")[0]) for key, value, why in t.not_carried] == [
        ("data.train_batch_size", "$BATCH", "$BATCH"),
        ("trainer.experiment_name", "exp_$(date +%m%d)", "$(date +%m%d)"),
        ("trainer.project_name", "${PROJECT}", "${PROJECT}")]
    assert "not set in the script or the environment" in t.not_carried[0][2]
    out = tmp_path / "mine.yaml"
    v2c.main([str(script), "-o", str(out)])
    assert "#   data.train_batch_size: $BATCH  # $BATCH: not set" in out.read_text()
    assert "$" not in "".join(ln for ln in out.read_text().splitlines() if not ln.startswith("#"))
    # given by the environment, it is carried
    t = v2c.translate_sources([], str(script), [], env={"BATCH": "128", "PROJECT": "p"})
    assert t.carried["train_batch_size"][0] == 128 and t.carried["mlflow_experiment"][0] == "p"
    # given after the script, the later value is carried and the unresolved one still named
    t = v2c.translate_sources([], str(script), ["data.train_batch_size=32"], env={})
    assert t.carried["train_batch_size"][:2] == (32, "data.train_batch_size")
    assert t.not_carried[0][2].endswith("; a later override sets the key")


def test_a_comment_inside_the_continuation_ends_the_command_as_in_bash(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo \\\n    algorithm.gamma=0.9 \\\n"
                      "    # algorithm.lam=0.5 \\\n    algorithm.lam=0.7\n")
    read = v2c.read_launch_script(str(script), {})
    assert read.overrides == ["algorithm.gamma=0.9"]
    assert "line 3: a comment ending in a backslash ends the main_ppo command" in read.notes[0]


def test_a_script_without_main_ppo_is_a_clear_error(tmp_path):
    script = tmp_path / "prepare.sh"
    script.write_text("python3 examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k\n")
    with pytest.raises(SystemExit, match=r"prepare.sh: no `python3 -m verl.trainer.main_ppo`"):
        v2c.main([str(script)])
    other = tmp_path / "quote.sh"
    other.write_text("python3 -m verl.trainer.main_ppo data.truncation='error\n")
    with pytest.raises(SystemExit, match=r"quote.sh, line 1"):
        v2c.main([str(other)])
    with pytest.raises(SystemExit, match=r"missing.sh: no such launch script"):
        v2c.main([str(tmp_path / "missing.sh")])


# ---- keys carried for issue 43 ------------------------------------------------------------------
def test_the_critic_has_its_own_warmup_ratio():
    t = v2c.translate(v2c.resolve(v2c.read_verl([], ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                                                     "critic.optim.lr_warmup_steps_ratio=0.05"])))
    assert (t.carried["lr_warmup_steps_ratio"][0], t.carried["critic_lr_warmup_steps_ratio"][0]) == (0.1, 0.05)
    assert not t.not_carried


def test_the_reward_models_worker_settings_act_only_on_the_trained_stack():
    base = ["reward_model.enable=True", "reward_model.model.path=/rm"]
    t = v2c.translate(v2c.resolve(v2c.read_verl([], base + ["reward_model.micro_batch_size_per_gpu=32"])))
    assert t.carried["reward_model_micro_batch_size_per_device"][0] == 32 and not t.not_carried
    t = v2c.translate(v2c.resolve(v2c.read_verl([], base + ["reward_model.micro_batch_size=64",
                                                            "trainer.n_gpus_per_node=8"])))
    assert t.carried["reward_model_micro_batch_size_per_device"][:2] == (8, "reward_model.micro_batch_size")
    served = v2c.translate(v2c.resolve(v2c.read_verl([], base + [
        "reward_model.rollout.name=vllm", "reward_model.micro_batch_size_per_gpu=32",
        "reward_model.model.fsdp_config.param_offload=True"])))
    assert {"reward_model_micro_batch_size_per_device", "reward_offload"}.isdisjoint(served.carried)
    assert [k for k, _, why in served.not_carried if "served on vLLM" in why] == [
        "reward_model.micro_batch_size_per_gpu", "reward_model.model.fsdp_config.param_offload"]
    off = v2c.translate(v2c.resolve(v2c.read_verl([], ["reward_model.micro_batch_size_per_gpu=32"])))
    assert not off.carried and "reward_model.enable=true" in off.not_carried[0][2]


def test_the_reference_pass_and_the_reward_model_keep_their_own_sizes():
    """verl's ref.log_prob_* sizes beside the rollout's (run_ppo.sh gives 8 and 4) are the reference
    pass's own; reward_model.use_dynamic_bsz and its token budget carry (reward_model.enable) and load."""
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024",
        "reward_model.enable=True", "reward_model.model.path=/rm", "reward_model.use_dynamic_bsz=True",
        "reward_model.forward_max_token_len_per_gpu=4096"])))
    assert not t.not_carried
    got = {k: v[0] for k, v in t.carried.items()}
    assert (got["log_prob_micro_batch_size_per_device"], got["ref_log_prob_micro_batch_size_per_device"]) == (8, 4)
    assert (got["log_prob_max_token_len_per_device"], got["ref_log_prob_max_token_len_per_device"]) == (2048, 1024)
    assert (got["reward_model_use_dynamic_bsz"], got["reward_model_max_token_len_per_device"]) == (True, 4096)
    config.validate_config(config.Config(**{k: v for k, v in got.items() if k != "reward_model_path"}))
    served = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "reward_model.enable=True", "reward_model.model.path=/rm", "reward_model.rollout.name=vllm",
        "reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=4096"])))
    assert [k for k, _, why in served.not_carried if "served on vLLM" in why] == [
        "reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu"]


@pytest.mark.parametrize("override, consumed", [
    ("actor_rollout_ref.rollout.multi_turn.format=hermes", True),      # what rollout/tools/parsing.py reads
    ("actor_rollout_ref.rollout.multi_turn.format=code_block", False),
    ("trainer.default_hdfs_dir=null", True),
    ("trainer.default_hdfs_dir=hdfs://x/ckpt", False),
    ("critic.model.use_rmpad=False", True),                             # verl's old name of use_remove_padding
])
def test_values_that_are_the_toolkits_behaviour_are_consumed_others_not(override, consumed):
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [override])))
    assert not t.carried and (len(t.used), len(t.not_carried)) == ((1, 0) if consumed else (0, 1))


def test_verls_older_kl_layout_carries_with_its_switches():
    """verl's early-2025 layout (actor.kl_loss.{type,coef}, algorithm.in_reward_kl.{type,coef,kl_ctrl}) had
    no use_kl_loss / use_kl_in_reward: a coefficient over 1e-6 switched each on, and so does the translation."""
    t = v2c.translate(v2c.resolve(v2c.read_verl([], [
        "actor_rollout_ref.actor.kl_loss.type=low_var_kl", "actor_rollout_ref.actor.kl_loss.coef=0.001",
        "algorithm.in_reward_kl.type=kl", "algorithm.in_reward_kl.kl_ctrl.type=fixed", "algorithm.in_reward_kl.coef=0"])))
    assert {k: v[0] for k, v in t.carried.items()} == {
        "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001, "use_kl_loss": True,
        "kl_penalty": "kl", "kl_ctrl_type": "fixed", "kl_coef": 0.0, "use_kl_in_reward": False}
    assert not t.not_carried
    given = v2c.translate(v2c.resolve(v2c.read_verl([], ["actor_rollout_ref.actor.kl_loss.coef=0.001",
                                                         "actor_rollout_ref.actor.use_kl_loss=False"])))
    assert given.carried["use_kl_loss"][:2] == (False, "actor_rollout_ref.actor.use_kl_loss")
