"""Translate a verl PPO config (a launch script, ppo_trainer YAML and/or Hydra overrides) into this toolkit's YAML.

    python scripts/verl_to_config.py run_qwen2.5-0.5b.sh -o configs/mine.yaml
    python scripts/verl_to_config.py --verl_config my_ppo_trainer.yaml -o configs/mine.yaml
    python scripts/verl_to_config.py -o configs/mine.yaml \\
        data.train_batch_size=256 actor_rollout_ref.actor.optim.lr=1e-6 algorithm.kl_ctrl.kl_coef=0.001

A launch script (a file given in place of the overrides) is read as bash would run it
(verl_launch_script.py): the overrides of its `main_ppo` command, its shell variables resolved from the
script's assignments and the environment; one that cannot be resolved is named and not carried.
Overrides are the `key=value` arguments of verl's example scripts (`+key=value`, `++key=value` and
`~key` work as in Hydra); they apply after the YAML files, in order: the script's first, then those
given after it (where the script's `$@` would put them). verl's defaults are not
available offline, so only what you give is translated: anything you leave out takes this
toolkit's default (python train_ppo.py --help), which is not always verl's.

Every verl key given is accounted for: the ones carried are written with the verl key they came
from, and every one that cannot be carried is printed (stderr) with its value and the reason, and
kept as a comment at the end of the output file. A key is carried only if this toolkit's Config has
the target key (checked at run time, so keys the toolkit gains later are picked up) and the value
is valid for it.
"""
import argparse
import dataclasses
import fnmatch
import os
import re
import sys
import typing
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import config  # the Config this translates to
from errors import UserError
from verl_launch_script import read_launch_script


class NotCarried(Exception):
    """A verl value that has no faithful counterpart here; the message says why."""


# ---- value converters (a converter returns the toolkit's value or raises NotCarried) -------------
def _path(value):
    """~ and $VARIABLES expanded"""
    return os.path.expanduser(os.path.expandvars(str(value)))


def _files(value):
    """a list of paths becomes one comma-separated string"""
    return ",".join(_path(v) for v in (value if isinstance(value, list) else [value]))


def _one_of(*allowed):
    def convert(value):
        if value not in allowed:
            raise NotCarried(f"the toolkit supports only {', '.join(map(str, allowed))}")
        return value
    convert.__doc__ = f"only {', '.join(map(str, allowed))}"
    return convert


def _rollout_is(value):
    """null (off), token or sequence"""
    if value is None:
        return "off"
    if value not in ("token", "sequence"):
        raise NotCarried("the toolkit's rollout_is is off (null), token or sequence")
    return value


def _top_k(value):
    """0 and -1 (off) -> -1"""
    return -1 if value == 0 else value          # verl: 0 (hf) and -1 (vllm) both mean "off"


def _warmup_steps(value):
    """-1 (verl: use the ratio) is not carried"""
    if isinstance(value, int) and value < 0:
        raise NotCarried("verl's -1 means 'use lr_warmup_steps_ratio'; set lr_warmup_steps yourself")
    return value


def _resume_mode(value):
    """auto -> auto, disable -> never; resume_path is not carried"""
    if value == "resume_path":
        raise NotCarried("a verl checkpoint cannot be resumed here; set resume to one of this toolkit's checkpoints")
    return {"auto": "auto", "disable": "never"}.get(value, value)


def _filter_metric(value):
    """seq_reward, score, acc, seq_final_reward"""
    if value not in config.FILTER_GROUPS_METRICS:
        raise NotCarried(f"the toolkit's metrics are {', '.join(config.FILTER_GROUPS_METRICS)} (null: set one; "
                         f"the toolkit's default is seq_reward)")
    return value


def _gen_batches(value):
    """0 or less (no limit) -> 0"""
    return max(0, value) if isinstance(value, int) and not isinstance(value, bool) else value


def _filter_overlong(value):
    """true -> drop (wins over data.truncation)"""
    if value is True:
        return "drop"                           # verl drops prompts over max_prompt_length before training
    raise NotCarried("false is verl's default: data.truncation decides (carried from it)")


def _served_by(value):
    """vllm: the reward model on a vLLM pooling engine of its own"""
    if value != "vllm":
        raise NotCarried(f"only vllm serves a reward model here (reward_model_engine=vllm); {value!r} is not built")
    return "vllm"


def _mapping(value):
    """the mapping as it is (its dotted leaves gathered into one)"""
    return dict(value)


def _greedy_validation(value):
    """false -> 0 (greedy validation), whatever val_kwargs.temperature says"""
    if value is False:
        return 0.0                              # do_sample=false: greedy, whatever the temperature
    raise NotCarried("the toolkit samples for validation when val_temperature > 0 "
                     "(see actor_rollout_ref.rollout.val_kwargs.temperature)")


# ---- the mapping: verl key -> toolkit key, or (toolkit key, converter) ---------------------------
# Targets that config.Config may not have yet (use_dynamic_bsz, lora_*, overlong_*, ...) are the
# names the design and issues give them; until the toolkit has them, they are reported as not carried.
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
MAPPING = {
    # data
    "data.train_files": ("train_files", _files),
    "data.val_files": ("val_files", _files),
    "data.prompt_key": "prompt_key",
    "data.max_prompt_length": "max_prompt_length",
    "data.max_response_length": "max_response_length",
    "data.train_batch_size": "train_batch_size",
    "data.val_batch_size": "val_batch_size",
    "data.filter_overlong_prompts": ("prompt_truncation", _filter_overlong),   # before data.truncation: it wins
    "data.truncation": ("prompt_truncation", _one_of("error", "left")),
    "data.seed": "seed",
    "data.apply_chat_template_kwargs": ("chat_template_kwargs", _mapping),
    # models
    "actor_rollout_ref.model.path": ("model_path", _path),
    "actor_rollout_ref.model.lora_rank": "lora_rank",
    "actor_rollout_ref.model.lora_alpha": "lora_alpha",
    "actor_rollout_ref.model.target_modules": "lora_target_modules",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "gradient_checkpointing",
    "critic.model.enable_gradient_checkpointing": "critic_gradient_checkpointing",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "ref_offload",
    "critic.model.path": ("critic_model_path", _path),
    "reward_model.model.path": ("reward_model_path", _path),
    "reward_model.model.fsdp_config.param_offload": "reward_offload",
    "reward_model.rollout.name": ("reward_model_engine", _served_by),
    "reward_model.rollout.gpu_memory_utilization": "reward_model_gpu_memory_utilization",
    "reward_model.micro_batch_size_per_gpu": "reward_model_micro_batch_size_per_device",
    "reward_model.use_dynamic_bsz": "reward_model_use_dynamic_bsz",
    "reward_model.forward_max_token_len_per_gpu": "reward_model_max_token_len_per_device",
    "reward_model.overlong_buffer.len": "overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "overlong_penalty_factor",
    # actor
    A + "optim.lr": "actor_lr",
    A + "optim.weight_decay": "weight_decay",
    A + "optim.lr_warmup_steps": ("lr_warmup_steps", _warmup_steps),
    A + "optim.lr_warmup_steps_ratio": "lr_warmup_steps_ratio",
    A + "optim.min_lr_ratio": "min_lr_ratio",
    A + "optim.warmup_style": "lr_scheduler_type",
    A + "optim.lr_scheduler_type": "lr_scheduler_type",
    A + "ppo_mini_batch_size": "ppo_mini_batch_size",
    A + "ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_device",
    A + "use_dynamic_bsz": "use_dynamic_bsz",
    A + "ppo_max_token_len_per_gpu": "ppo_max_token_len_per_device",
    A + "ppo_epochs": "ppo_epochs",
    A + "clip_ratio": "clip_ratio",
    A + "clip_ratio_low": "clip_ratio_low",
    A + "clip_ratio_high": "clip_ratio_high",
    A + "clip_ratio_c": "clip_ratio_c",
    A + "entropy_coeff": "entropy_coeff",
    A + "use_kl_loss": "use_kl_loss",
    A + "kl_loss_coef": "kl_loss_coef",
    A + "kl_loss_type": "kl_loss_type",
    A + "loss_agg_mode": "loss_agg_mode",
    A + "grad_clip": "max_grad_norm",
    A + "kl_loss.type": "kl_loss_type",                 # verl's early-2025 layout (kl_loss.coef > 1e-6: on)
    A + "kl_loss.coef": "kl_loss_coef",
    # rollout
    R + "name": ("rollout_engine", _one_of("vllm", "hf")),
    R + "n": "rollout_n",
    R + "temperature": "temperature",
    R + "top_p": "top_p",
    R + "top_k": ("top_k", _top_k),
    R + "ignore_eos": "rollout_ignore_eos",
    R + "prompt_length": "max_prompt_length",
    R + "response_length": "max_response_length",
    R + "val_kwargs.do_sample": ("val_temperature", _greedy_validation),   # before .temperature: it wins
    R + "val_kwargs.temperature": "val_temperature",
    R + "val_kwargs.top_p": "top_p",
    R + "val_kwargs.top_k": ("top_k", _top_k),
    R + "gpu_memory_utilization": "rollout_gpu_memory_utilization",
    R + "log_prob_micro_batch_size_per_gpu": "log_prob_micro_batch_size_per_device",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref_log_prob_micro_batch_size_per_device",
    R + "enforce_eager": "rollout_enforce_eager",
    R + "free_cache_engine": "rollout_sleep",
    R + "max_num_batched_tokens": "rollout_max_num_batched_tokens",
    R + "max_num_seqs": "rollout_max_num_seqs",
    R + "tensor_model_parallel_size": "rollout_tensor_model_parallel_size",
    R + "log_prob_max_token_len_per_gpu": "log_prob_max_token_len_per_device",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "ref_log_prob_max_token_len_per_device",
    A + "ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "actor_rollout_ref.model.enable_activation_offload": "activation_offload",
    "critic.model.enable_activation_offload": "activation_offload",
    # critic (shared keys must agree with the actor's: the toolkit has one value for both)
    "critic.optim.lr": "critic_lr",
    "critic.optim.weight_decay": "weight_decay",
    "critic.optim.lr_warmup_steps": ("lr_warmup_steps", _warmup_steps),
    "critic.optim.lr_warmup_steps_ratio": "critic_lr_warmup_steps_ratio",
    "critic.grad_clip": "critic_max_grad_norm",
    "critic.cliprange_value": "cliprange_value",
    "critic.ppo_mini_batch_size": "critic_ppo_mini_batch_size",            # the critic's own schedule
    "critic.ppo_micro_batch_size_per_gpu": "critic_ppo_micro_batch_size_per_device",
    "critic.ppo_epochs": "critic_ppo_epochs",
    "critic.ppo_max_token_len_per_gpu": "critic_ppo_max_token_len_per_device",
    "critic.loss_agg_mode": "loss_agg_mode",
    "critic.use_dynamic_bsz": "use_dynamic_bsz",
    "critic.rollout_n": "rollout_n",
    # algorithm
    "algorithm.adv_estimator": "adv_estimator",
    "algorithm.gamma": "gamma",
    "algorithm.lam": "lam",
    "algorithm.norm_adv_by_std_in_grpo": "norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward": "use_kl_in_reward",
    "algorithm.kl_penalty": "kl_penalty",
    "algorithm.kl_ctrl.type": "kl_ctrl_type",
    "algorithm.kl_ctrl.kl_coef": "kl_coef",
    "algorithm.kl_ctrl.target_kl": "target_kl",
    "algorithm.kl_ctrl.horizon": "kl_horizon",
    "algorithm.in_reward_kl.type": "kl_penalty",        # the same layout (in_reward_kl.coef > 1e-6: on)
    "algorithm.in_reward_kl.coef": "kl_coef",
    "algorithm.in_reward_kl.kl_ctrl.type": "kl_ctrl_type",
    "algorithm.in_reward_kl.kl_ctrl.target_kl": "target_kl",
    "algorithm.in_reward_kl.kl_ctrl.horizon": "kl_horizon",
    "algorithm.filter_groups.enable": "filter_groups_enable",
    "algorithm.filter_groups.metric": ("filter_groups_metric", _filter_metric),
    "algorithm.filter_groups.max_num_gen_batches": ("max_num_gen_batches", _gen_batches),
    "algorithm.use_pf_ppo": "use_pf_ppo",
    "algorithm.pf_ppo.reweight_method": "pf_ppo_reweight_method",
    "algorithm.pf_ppo.weight_pow": "pf_ppo_weight_pow",
    "algorithm.rollout_correction.bypass_mode": "rollout_bypass_mode",
    "algorithm.rollout_correction.rollout_is": ("rollout_is", _rollout_is),
    "algorithm.rollout_correction.rollout_is_threshold": "rollout_is_threshold",
    # trainer (total_epochs: the toolkit counts the steps at setup, as verl does)
    "trainer.total_training_steps": "total_training_steps",
    "trainer.total_epochs": "total_epochs",
    "trainer.save_freq": "save_freq",
    "trainer.resume_mode": ("resume", _resume_mode),
    "trainer.max_actor_ckpt_to_keep": "save_total_limit",
    "trainer.max_critic_ckpt_to_keep": "save_total_limit",
    "trainer.test_freq": "test_freq",
    "trainer.val_before_train": "val_before_train",
    "trainer.critic_warmup": "critic_warmup",
    "trainer.default_local_dir": ("output_dir", _path),
    "trainer.project_name": "mlflow_experiment",
    "trainer.experiment_name": "run_name",
    "trainer.log_val_generations": "log_samples",
    "trainer.log_system_metrics": "mlflow_system_metrics",
    "async_training.partial_rollout": ("partial_rollout", _one_of(False)),
}

# verl keys that only switch others on: carried as the keys they enable (verl's default is off).
GATES = {
    "reward_model.model.path": "reward_model.enable",
    "reward_model.model.fsdp_config.param_offload": "reward_model.enable",
    "reward_model.rollout.name": "reward_model.enable",
    "reward_model.rollout.gpu_memory_utilization": "reward_model.enable",
    "reward_model.micro_batch_size_per_gpu": "reward_model.enable",
    "reward_model.use_dynamic_bsz": "reward_model.enable",
    "reward_model.forward_max_token_len_per_gpu": "reward_model.enable",
    "reward_model.overlong_buffer.len": "reward_model.overlong_buffer.enable",
    "reward_model.overlong_buffer.penalty_factor": "reward_model.overlong_buffer.enable",
}

# verl's global micro-batch sizes (deprecated there): divided by trainer.n_gpus_per_node x trainer.nnodes, as verl does.
PER_GPU = {
    A + "ppo_micro_batch_size": "ppo_micro_batch_size_per_device",
    "critic.ppo_micro_batch_size": "critic_ppo_micro_batch_size_per_device",
    R + "log_prob_micro_batch_size": "log_prob_micro_batch_size_per_device",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "ref_log_prob_micro_batch_size_per_device",
    "reward_model.micro_batch_size": "reward_model_micro_batch_size_per_device",
}

# verl keys whose every value this toolkit already honours in its own way: nothing to set.
ALWAYS = {
    "*.use_rmpad": "verl's older name for use_remove_padding: the toolkit packs each micro-batch's sequences "
                   "without padding by default (remove_padding)",
    "*.use_remove_padding": "the toolkit packs each micro-batch's sequences without padding by default "
                            "(remove_padding), in the training and the no-grad passes",
    "actor_rollout_ref.hybrid_engine": "generation and training always share the GPUs (vLLM sleeps while the "
                                       "models train)",
    "data.return_raw_chat": "prompts given as chat messages are always rendered with the tokenizer's chat template",
    "reward_model.use_reward_loop": "verl's way of computing rewards (its reward loop, or the older reward workers); "
                                    "here each rank scores its own samples after generating, and "
                                    "reward_model.rollout.name=vllm carries as reward_model_engine=vllm",
    "trainer.use_legacy_worker_impl": "it picks between verl's own worker implementations, which compute the same "
                                      "algorithm; the toolkit has one",
}

# verl values that are this toolkit's behaviour (a pattern: every key it matches); another value is not carried.
FIXED_PATTERNS = {
    "*fsdp_config.*offload": (False, "nothing is offloaded unless the accelerate config says so"),
}

# verl values that are this toolkit's fixed behaviour: nothing to set when the value matches.
FIXED = {
    R + "do_sample": True,
    "reward_model.rollout.tensor_model_parallel_size": 1,
    R + "val_kwargs.n": 1,
    A + "policy_loss.loss_mode": "vanilla",
    "data.shuffle": True,
    "trainer.default_hdfs_dir": None,           # verl's null: checkpoints are not copied to HDFS, nor here
    R + "multi_turn.format": "hermes",          # <tool_call>{json}</tool_call>, what rollout/tools/parsing.py reads
}

# Why common verl keys have no counterpart (fnmatch patterns; the first match wins).
HINTS = {
    "*._target_": "Hydra bookkeeping, not a setting",
    "*use_fused_kernels": "verl's fused LM-head kernels: the log-probs here come from the plain LM head "
                          "(forward/), without a fused kernel",
    "*fused_kernel_options.*": "verl's fused LM-head kernels: the log-probs here come from the plain LM head",
    "reward_model.sandbox_fusion_url": "no remote code-execution service for rewards: reward functions run in "
                                       "process (the python tool has its own sandbox, tool_sandbox)",
    "defaults": "Hydra bookkeeping: the files it names are not read; pass them with --verl_config",
    "hydra.*": "Hydra bookkeeping, not a setting",
    "*fsdp_config.*": "sharding and offload come from the accelerate config (accelerate_configs/, ds_configs/)",
    "*.lr_warmup_steps_ratio": "set lr_warmup_steps = ratio x total_training_steps",
    "*ppo_micro_batch_size": "verl's global micro-batch: give trainer.n_gpus_per_node (and nnodes) to divide it",
    "*log_prob_micro_batch_size": "verl's global micro-batch: give trainer.n_gpus_per_node (and nnodes) to divide it",
    "custom_reward_function.*": "verl reward functions take (data_source, solution_str, ground_truth, extra_info); "
                                "set reward_fn to a toolkit function, e.g. rewards.gsm8k:compute_score",
    "reward_model.reward_manager": "one reward function per run: set reward_fn",
    "critic.enable": "the toolkit builds a critic exactly when adv_estimator needs one (gae)",
    "*profiler*": "no profiler settings",
    "ray_kwargs.*": "no Ray",
    "trainer.resume_from_path": "a verl checkpoint cannot be resumed here",
    R + "multi_turn.*": "verl's tool config files and formats do not carry over: set tools (or environment), "
                        "max_turns and tool_timeout_s here (docs/tools.md)",
    R + "mode": "verl's sync/async picks how its vLLM server is driven; both train on-policy, as colocated does "
                "here. Overlapping generation with training (off-policy) is rollout_mode (one_step_off | async)",
    "async_training.staleness_threshold": "verl's fully async recipe: a fraction of a sync's samples that may come "
                                          "from older weights, not a count of policy versions: set rollout_mode=async "
                                          "and max_staleness (versions)",
    "async_training.trigger_parameter_sync_step": "the weights go to the rollout side after every update here (one "
                                                  "step per sync)",
    "async_training.require_batches": "each step trains on one whole batch of train_batch_size prompts",
    "async_training.*": "verl's fully async recipe's own setting; the asynchronous modes here are rollout_mode, "
                        "max_staleness and rollout_processes",
    "*.strategy": "the toolkit trains with DeepSpeed ZeRO through Accelerate (accelerate_configs/), not FSDP/Megatron",
    "*megatron.*": "no Megatron parallelism",
    "*forward_max_token_len_per_gpu": "the no-grad passes use the actor's and critic's token budgets",
    "*log_prob_use_dynamic_bsz": "the no-grad passes batch like the update (use_dynamic_bsz)",
    "reward_model.micro_batch_size": "verl's global micro-batch: give trainer.n_gpus_per_node (and nnodes) to "
                                     "divide it",
    R + "enable_chunked_prefill": "vLLM's scheduler defaults are used",
    R + "load_format": "vLLM gets the actor's weights in process after every update",
    R + "layered_summon": "LoRA weights are merged and sent layer by layer already",
    R + "dtype": "the rollout follows dtype",
    "reward_model.rollout.prompt_length": "the served reward model reads each whole sequence (max_prompt_length + "
                                          "max_response_length tokens); an LLM judge's limits are "
                                          "reward_judge_prompt_length and reward_judge_max_tokens",
    "reward_model.rollout.response_length": "a served reward model writes nothing; an LLM judge's verdict length is "
                                            "reward_judge_max_tokens",
    "reward_model.num_workers": "each rank scores its own samples in its own process: there are no reward workers",
    "reward_model.rollout.*": "the served reward model's engine takes reward_model_gpu_memory_utilization (GPU) or "
                              "reward_model_kv_cache_gb (CPU); vLLM's other settings keep their defaults",
    "*.checkpoint.*": "checkpoints always hold weights, optimizer states and every RNG (see save_freq)",
}


# ---- reading verl's YAML and overrides ----------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """PyYAML reads 1e-6 as a string; OmegaConf (verl) reads it as a float, and so does this."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_value(text: str):
    """A Hydra override value: 1e-6, true, null, [a, b], 'quoted', or a plain string."""
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def flatten(tree, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def read_verl(yaml_files: list[str], overrides: list[str]) -> dict:
    """verl's settings as {dotted key: value}: the YAML files in order, then the overrides."""
    flat: dict = {}
    for path in yaml_files:
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such file")
        tree = yaml.load(Path(path).read_text(), Loader=_Loader) or {}
        if not isinstance(tree, dict):
            raise SystemExit(f"error: {path}: a verl config is a mapping, got {type(tree).__name__}")
        flat.update(flatten(tree))
    for item in overrides:
        if item.startswith("~"):                          # Hydra: delete the key (and what is under it)
            key = item[1:].split("=", 1)[0]
            flat = {k: v for k, v in flat.items() if k != key and not k.startswith(key + ".")}
            continue
        if "=" not in item:
            raise SystemExit(f"error: override {item!r} is not key=value")
        key, text = item.lstrip("+").split("=", 1)
        value = parse_value(text)
        flat = {k: v for k, v in flat.items() if not k.startswith(key + ".")}
        flat.update(flatten(value, key + ".") if isinstance(value, dict) and value else {key: value})
    return flat


_INTERP = re.compile(r"\$\{([^}]*)\}")
_UNRESOLVED = object()


def resolve(flat: dict) -> dict:
    """OmegaConf interpolations: ${a.b}, ${.sibling}, ${oc.select:a.b,default}, also inside a string.
    One that points to a key not given stays as written, and is then reported, not carried."""
    def lookup(expr: str, key: str, depth: int):
        default = _UNRESOLVED
        if expr.startswith("oc.select:"):
            expr, comma, fallback = expr[len("oc.select:"):].partition(",")
            if comma:
                default = parse_value(fallback.strip().strip("'\""))
        if expr.startswith("."):                          # relative: a sibling of `key`
            expr = key.rsplit(".", 1)[0] + expr if "." in key else expr[1:]
        if expr in flat and ":" not in expr and depth < 10:
            return value_of(expr, depth + 1)
        return default                                    # oc.env and other resolvers: not resolved

    def value_of(key: str, depth: int = 0):
        value = flat[key]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERP.fullmatch(value)
        if whole:
            found = lookup(whole.group(1), key, depth)
            return value if found is _UNRESOLVED else found
        parts = {m.group(0): lookup(m.group(1), key, depth) for m in _INTERP.finditer(value)}
        if any(p is _UNRESOLVED for p in parts.values()):
            return value
        for text, part in parts.items():
            value = value.replace(text, str(part))
        return value

    return {key: value_of(key) for key in flat}


# ---- the translation ----------------------------------------------------------------------------
@dataclasses.dataclass
class Translation:
    carried: dict       # toolkit key -> (value, the verl key it came from, how, if not as it was)
    used: list          # (verl key, value, note): consumed with nothing (more) to set
    not_carried: list   # (verl key, value, reason)
    launch: str = ""    # the accelerate launch line that trainer.n_gpus_per_node / trainer.nnodes make
    notes: list = dataclasses.field(default_factory=list)   # about the source (a launch script's reading)


# verl keys whose value is a mapping (flattened on reading): gathered back into one before translating.
MAPPINGS = ("data.apply_chat_template_kwargs",)


def _gather(flat: dict) -> dict:
    """MAPPINGS' dotted leaves (data.apply_chat_template_kwargs.enable_thinking=false) as one mapping each."""
    out = {}
    for key, value in flat.items():
        parent = next((m for m in MAPPINGS if key.startswith(m + ".")), None)
        if parent is None:
            out[key] = value
            continue
        node = out.setdefault(parent, {})
        if not isinstance(node, dict):
            node = out[parent] = {}
        *inner, leaf = key[len(parent) + 1:].split(".")
        for part in inner:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def translate(flat: dict) -> Translation:
    """Map resolved verl settings {dotted key: value} onto config.Config's keys."""
    flat = _gather(flat)
    hints = typing.get_type_hints(config.Config)
    out = Translation({}, [], [])
    gates = set(GATES.values())
    # Mapped keys go in MAPPING's order: where two verl keys set one toolkit key, the first listed is the
    # source and a different value from the second is a conflict (val_kwargs.do_sample=false comes before
    # val_kwargs.temperature because verl then validates greedily whatever the temperature says).
    rank = {key: i for i, key in enumerate(MAPPING)}
    for key in sorted(flat, key=lambda k: rank.get(k, len(rank))):
        value = flat[key]
        if key in LAUNCH:
            continue                                      # after the loop: both together make the launch line
        if key == "trainer.total_training_steps" and value is None and "trainer.total_epochs" in flat:
            out.used.append((key, value, "null: the steps are counted from trainer.total_epochs"))
            continue
        if key == "trainer.total_epochs" and flat.get("trainer.total_training_steps") is not None:
            out.used.append((key, value, "moot: verl runs trainer.total_training_steps when it is set"))
            continue
        if key in gates:
            enables = [k for k, g in GATES.items() if g == key and k in flat]
            out.used.append((key, value, f"switches on {', '.join(enables)}" if value is True and enables
                             else "a switch: what it enables is carried only when it is true"))
            continue
        always = next((why for pattern, why in ALWAYS.items() if fnmatch.fnmatchcase(key, pattern)), None)
        if always:
            out.used.append((key, value, always))
            continue
        if (key in ("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold")
                and flat.get("algorithm.rollout_correction.rollout_is") is not None
                and flat.get("algorithm.rollout_correction.bypass_mode") is True):
            out.not_carried.append((key, value, "with bypass_mode, verl's default ppo_clip loss computes these weights "
                                                "for its rollout_corr/* metrics only; the toolkit's bypass mode has no "
                                                "rollout_is (its PPO ratio is against the sampler)"))
            continue
        if key == "data.truncation" and flat.get("data.filter_overlong_prompts") is True:
            out.used.append((key, value, "moot: data.filter_overlong_prompts drops over-long prompts first"))
            continue
        if key in TRAINED_RM_KEYS and value is not False and _trained_rm_moot(flat):
            out.not_carried.append((key, value, _trained_rm_moot(flat)))
            continue
        if key in PER_GPU:
            gpus = flat.get("trainer.n_gpus_per_node")
            nodes = flat.get("trainer.nnodes", 1)
            if isinstance(gpus, int) and isinstance(nodes, int) and isinstance(value, int) and value % (gpus * nodes) == 0:
                target = PER_GPU[key]
                if target in out.carried and out.carried[target][0] != value // (gpus * nodes):
                    out.not_carried.append((key, value, f"conflicts with {out.carried[target][1]}: the toolkit has "
                                                        f"one {target}"))
                elif target not in out.carried:
                    out.carried[target] = (value // (gpus * nodes), key, f"{value} / ({gpus} GPUs x {nodes} nodes)")
                else:
                    out.used.append((key, value, f"same {target} as {out.carried[target][1]}"))
                continue
        fixed = next(((v, why) for pattern, (v, why) in FIXED_PATTERNS.items() if fnmatch.fnmatchcase(key, pattern)),
                     None)
        if fixed is not None and value == fixed[0] and type(value) is type(fixed[0]):
            out.used.append((key, value, fixed[1]))
            continue
        if key == "trainer.logger":
            _loggers(key, value, out)
            continue
        if key in FIXED:
            if value == FIXED[key] and type(value) is type(FIXED[key]):
                out.used.append((key, value, "the toolkit's fixed behaviour"))
            else:
                out.not_carried.append((key, value, f"the toolkit supports only {FIXED[key]!r}"))
            continue
        if key not in MAPPING:
            reason = next((why for pattern, why in HINTS.items() if fnmatch.fnmatchcase(key, pattern)),
                          "no counterpart in the toolkit")
            out.not_carried.append((key, value, reason))
            continue
        try:
            target, value = _carry(key, value, flat, hints)
        except NotCarried as e:
            out.not_carried.append((key, flat[key], str(e)))
            continue
        if target in out.carried:
            other_value, other, _ = out.carried[target]
            if other_value != value:
                out.not_carried.append((key, flat[key], f"conflicts with {other}, which sets {target}="
                                                        f"{other_value!r}: the toolkit has one {target}"))
            else:
                out.used.append((key, flat[key], f"same {target} as {other}"))
            continue
        out.carried[target] = (value, key, "")
    _launch(flat, out)
    _older_kl_switches(flat, out)
    position = {key: i for i, key in enumerate(flat)}        # report in the order the user wrote them
    out.used.sort(key=lambda item: position[item[0]])
    out.not_carried.sort(key=lambda item: position[item[0]])
    return out


# verl's trainer.logger list (the docs' table says this)
LOGGER_NOTE = ("true when the list holds wandb; console and mlflow are always on; any other logger (tensorboard, "
               "swanlab, clearml, ...) is not carried, by name")


def _loggers(key: str, value, out: Translation) -> None:
    """trainer.logger -> wandb, as LOGGER_NOTE says."""
    names = value if isinstance(value, list) else [value]
    extra = [str(x) for x in names if x not in ("console", "mlflow", "wandb")]
    if "wandb" in names:
        out.carried["wandb"] = (True, key, "wandb in the list (console and MLflow are always on)")
    elif not extra:
        out.used.append((key, value, "the toolkit always writes the console, metrics.jsonl and an MLflow run"))
    if extra:
        out.not_carried.append((key, value, f"no {', '.join(extra)}: the toolkit writes the console, metrics.jsonl, "
                                            "an MLflow run and (wandb=true) a W&B run"))


# verl's early-2025 layout had no use_kl_loss / use_kl_in_reward: a coefficient over 1e-6 switched each on.
OLDER_KL_SWITCHES = {A + "kl_loss.coef": (A + "use_kl_loss", "use_kl_loss"),
                     "algorithm.in_reward_kl.coef": ("algorithm.use_kl_in_reward", "use_kl_in_reward")}


def _older_kl_switches(flat: dict, out: Translation) -> None:
    """The switch an older-layout KL coefficient implies, carried beside the coefficient (unless the
    switch itself is given)."""
    for key, (switch, target) in OLDER_KL_SWITCHES.items():
        coef = out.carried.get(MAPPING[key])
        if coef is not None and coef[1] == key and switch not in flat:
            out.carried[target] = (coef[0] > 1e-6, key, "verl's older layout: on when the coefficient is over 1e-6")


# verl's settings of the reward model's FSDP worker: here the trained-stack reward model's
TRAINED_RM_KEYS = ("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu",
                   "reward_model.model.fsdp_config.param_offload", "reward_model.use_dynamic_bsz",
                   "reward_model.forward_max_token_len_per_gpu")


def _trained_rm_moot(flat: dict) -> str:
    """Why a setting of verl's reward-model worker does not act in this run ('' when it does)."""
    if flat.get("reward_model.enable") is not True:
        return "verl ignores it unless reward_model.enable=true"
    if flat.get("reward_model.rollout.name") == "vllm":
        return ("the reward model is served on vLLM (reward_model.rollout.name=vllm); this setting is the "
                "trained stack's reward model's")
    return ""


def _carry(key: str, value, flat: dict, hints: dict):
    """(toolkit key, checked value) for one mapped verl key, or NotCarried."""
    target, convert = MAPPING[key] if isinstance(MAPPING[key], tuple) else (MAPPING[key], None)
    if key in GATES and flat.get(GATES[key]) is not True:
        raise NotCarried(f"verl ignores it unless {GATES[key]}=true")
    if isinstance(value, str) and "${" in value:
        raise NotCarried("an interpolation whose key is not given")
    if value == "???":
        raise NotCarried("verl's ??? (a value still to be given)")
    if target not in hints:
        raise NotCarried(f"the toolkit has no {target!r} key (yet)")
    if convert is not None:
        value = convert(value)
    optional = typing.get_origin(hints[target]) is typing.Union
    if value is None and not optional:
        raise NotCarried(f"null (verl's 'not set'): {target} keeps the toolkit's default")
    if isinstance(value, (list, dict)) and not (isinstance(value, dict) and hints[target] is dict):
        raise NotCarried(f"{target} takes one value, not a {type(value).__name__}")
    try:
        return target, config._coerce(target, value)
    except UserError as e:
        raise NotCarried(str(e)) from None


LAUNCH = ("trainer.n_gpus_per_node", "trainer.nnodes")


def _launch(flat: dict, out: Translation) -> None:
    """trainer.n_gpus_per_node and trainer.nnodes are the launch's, not the config's: carried into the
    `accelerate launch` line written at the top of the output (one process per GPU)."""
    given = [key for key in LAUNCH if key in flat]
    gpus, nodes = flat.get(LAUNCH[0], 1), flat.get(LAUNCH[1], 1)
    if not given:
        return
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (gpus, nodes)):
        out.not_carried += [(key, flat[key], "not a positive whole number of GPUs or nodes") for key in given]
        return
    out.launch = ("python train_ppo.py --config THIS_FILE" if gpus * nodes == 1 else
                  f"accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes {gpus * nodes}"
                  + (f" --num_machines {nodes}" if nodes > 1 else "") + " train_ppo.py --config THIS_FILE")
    out.used += [(key, flat[key], f"in the launch line: {out.launch}") for key in given]


# ---- output -------------------------------------------------------------------------------------
def _show(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def to_yaml(t: Translation, sources: str) -> str:
    order = [f.name for f in dataclasses.fields(config.Config)]
    lines = [f"# Translated from verl ({sources}) by scripts/verl_to_config.py.",
             "# Keys not written here take this toolkit's defaults (python train_ppo.py --help), not verl's."]
    lines += [f"# Note: {note}" for note in t.notes]
    if t.launch:
        lines.append(f"# Launch: {t.launch}")
    for name in sorted(t.carried, key=order.index):
        value, source, how = t.carried[name]
        lines.append(f"{name}: {_show(value)}  # {source}" + (f": {how}" if how else ""))
    if t.not_carried:
        lines.append("")
        lines.append("# Not carried from verl (key: value  # why):")
        lines += [f"#   {key}: {_show(value)}  # {why}" for key, value, why in t.not_carried]
    return "\n".join(lines) + "\n"


def report(t: Translation) -> str:
    lines = [f"carried ({len(t.carried)}):"]
    lines += [f"  {source} -> {name}: {_show(value)}" + (f"  ({how})" if how else "")
              for name, (value, source, how) in t.carried.items()]
    if t.used:
        lines.append(f"nothing more to set ({len(t.used)}):")
        lines += [f"  {key} = {_show(value)}  ({note})" for key, value, note in t.used]
    if t.launch:
        lines.append(f"launch with: {t.launch}")
    lines += [f"note: {note}" for note in t.notes]
    lines.append(f"NOT carried ({len(t.not_carried)}):")
    lines += [f"  {key} = {_show(value)}  ({why})" for key, value, why in t.not_carried]
    return "\n".join(lines)


def _is_script(arg: str) -> bool:
    """A launch script, not an override: a .sh name or a file's path, with no = in it."""
    return "=" not in arg and not arg.startswith(("~", "+")) and (arg.endswith(".sh") or Path(arg).is_file())


def _unresolved_reason(names: list) -> str:
    plain = all(re.fullmatch(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", name) for name in names)
    return (f"{', '.join(names)}: not set in the script or the environment" if plain else
            f"{', '.join(names)}: a command, positional argument or expansion the translator does not run")


def translate_sources(yaml_files: list, script_path: str, overrides: list, env=None) -> Translation:
    """The translation of verl's YAML files, a launch script's main_ppo overrides (variables from the
    script and `env`, default os.environ) and further overrides, applied in that order."""
    script = read_launch_script(script_path, dict(os.environ if env is None else env)) if script_path else None
    flat = resolve(read_verl(yaml_files, (script.overrides if script else []) + list(overrides)))
    t = translate(flat)
    if script:
        t.notes = [f"read the main_ppo command at line {script.line} of {script_path}"] + script.notes
        t.not_carried += [(key, text.split("=", 1)[-1], _unresolved_reason(names)
                           + ("; a later override sets the key" if key in flat else ""))
                          for key, text, names in script.unresolved]
    return t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="a verl launch script (.sh), then verl overrides: key=value, "
                                                     "+key=value, ~key")
    parser.add_argument("--verl_config", action="append", default=[], help="a verl ppo_trainer YAML (repeatable)")
    parser.add_argument("-o", "--out", default="", help="write the toolkit YAML here (default: stdout)")
    args = parser.parse_intermixed_args(argv)   # the script, -o FILE, then overrides, in any order
    if not args.verl_config and not args.overrides:
        parser.error("give a launch script, --verl_config FILE and/or key=value overrides")
    script_path = args.overrides.pop(0) if args.overrides and _is_script(args.overrides[0]) else ""
    try:
        t = translate_sources(args.verl_config, script_path, args.overrides)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    sources = ", ".join(args.verl_config + [script_path] * bool(script_path)
                        + ([f"{len(args.overrides)} overrides"] if args.overrides else []))
    text = to_yaml(t, sources)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    print(report(t), file=sys.stderr)
    try:
        config.validate_config(config.Config(**{name: value for name, (value, *_) in t.carried.items()}))
    except UserError as e:
        print(f"note: the result does not run as it is yet: {e}", file=sys.stderr)
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
