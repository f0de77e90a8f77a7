"""PPO for language models in one flat file: verl's algorithm, the Hugging Face stack.

An actor is trained with PPO against a reward (a verifier function or a reward model), with a
critic for GAE (or a critic-free estimator), a frozen reference model for KL regularisation (KL
in the reward with a fixed or adaptive controller, and/or KL as a loss; see kl/), dual-clip,
value clipping, entropy bonus and gradient clipping. The math is verl 0.9.1's, written below as
pure functions; one iteration is the numbered phases of `main`.

    python train_ppo.py                                    # built-in demo: tiny model, arithmetic, CPU
    python train_ppo.py --config configs/demo.yaml --total_training_steps=20 --output_dir runs/x
    accelerate launch --config_file accelerate_configs/zero3.yaml train_ppo.py --config configs/X.yaml

Outputs: <output_dir>/config.yaml, <output_dir>/metrics.jsonl (one line per step), an MLflow run
(local SQLite store unless MLFLOW_TRACKING_URI says otherwise) and <output_dir>/final/ (the actor
in Hugging Face format).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import os
import sys
import time
import typing
import zlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

import config_docs
import console
import distributed
import flops
import host_memory
import kl
import lean_imports
import packing
import preflight
import value_models
from checkpoints import StopSignal, check_resumable, find_checkpoint, load_checkpoint, read_state, save_checkpoint
from distributed import Role, gathered_params, param_share
from errors import UserError, first_line
from guards import Guards, rescale_lr, resumed_lr_scale
from head_logprobs import head_logprobs, support_logprobs, truncated_logprobs
from rollout import SamplingParams
from tracking import Tracker, run_tags

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# Config: one flat dataclass. Defaults (the demo) <- YAML file(s) (--config) <- --key=value.
# ----------------------------------------------------------------------------------------------
def opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # models
    model_path: str = opt(str(HERE / "examples/demo_model"), "actor (policy) model directory, Hugging Face format")
    critic_model_path: str = opt("", "critic: a causal LM (a value head is added), a token classifier or a reward "
                                     "model (its head is kept). '' = the actor's initial weights")
    ref_model_path: str = opt("", "frozen reference model for KL. '' = the actor's initial weights")
    reward_model_path: str = opt("", "reward model (sequence classifier with 1 label, or a base model saved with "
                                     "its score head); when set, replaces reward_fn")
    reward_fn: str = opt("rewards.arithmetic:compute_score", "'module:function' called as fn(prompts, responses) -> list of floats")
    # reward shaping
    reward_clip: float = opt(0.0, "clip each sequence score to [-reward_clip, reward_clip] (after shaping); 0 = off")
    overlong_buffer_len: int = opt(0, "DAPO overlong shaping: penalise responses longer than max_response_length - this; 0 = off")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong shaping: the penalty at max_response_length")
    truncation_penalty: float = opt(0.0, "subtracted from the score of a response cut at max_response_length without EOS")
    # precision
    dtype: str = opt("fp32", "fp32 | bf16 (bf16 autocast for forward passes; weights and optimizer stay fp32)")
    # LoRA
    lora_rank: int = opt(0, "train the actor as LoRA adapters of this rank (PEFT); the reference is then the base "
                            "model with the adapters disabled (no second copy); 0 = full fine-tuning")
    lora_alpha: float = opt(16.0, "LoRA scaling numerator (scale = lora_alpha / lora_rank)")
    lora_target_modules: str = opt("all-linear", "modules that get adapters: all-linear, or a comma-separated list of names")
    lora_save_merged: bool = opt(False, "LoRA: also save the merged full model in final/merged")
    # data
    train_files: str = opt(str(HERE / "examples/data/train.parquet"), "training prompts: parquet or jsonl files, comma-separated")
    val_files: str = opt(str(HERE / "examples/data/val.parquet"), "validation prompts (same format); '' = no validation")
    prompt_key: str = opt("prompt", "column holding the prompt: a string, or a list of chat messages")
    max_prompt_length: int = opt(16, "prompt tokens at most")
    prompt_truncation: str = opt("error", "what to do with a longer prompt: error | left (keep its last tokens) | "
                                          "drop (leave the row out, counted in the log; verl's filter_overlong_prompts)")
    max_response_length: int = opt(4, "response tokens at most")
    # SFT mix (InstructGPT's PPO-ptx): supervised data in the actor update
    sft_files: str = opt("", "supervised data mixed into every actor mini-batch: parquet or jsonl files with prompt and "
                             "response columns, comma-separated; '' = off")
    sft_prompt_key: str = opt("prompt", "SFT: the prompt column (a string, or a list of chat messages)")
    sft_response_key: str = opt("response", "SFT: the response column (a string; EOS is appended)")
    sft_coef: float = opt(0.1, "SFT: weight of the next-token NLL (mean over response tokens) added to the actor loss")
    sft_batch_size: int = opt(0, "SFT: sequences per actor mini-batch, all processes together (a multiple of their "
                                 "number); 0 = 5% of the mini-batch's sequences, at least one per process")
    # run
    output_dir: str = opt("runs/demo", "where config.yaml, metrics.jsonl and final/ go")
    seed: int = opt(0, "seed for data order, sampling and initialisation")
    total_training_steps: int = opt(300, "PPO iterations")
    train_batch_size: int = opt(64, "prompts per iteration (all ranks together)")
    test_freq: int = opt(25, "validate every N steps (and after the last); -1 = never")
    val_before_train: bool = opt(True, "validate before the first step (logged as step 0)")
    save_freq: int = opt(-1, "checkpoint every N steps (also on SIGTERM/SIGINT, then exit); -1 = only on a signal")
    save_total_limit: int = opt(2, "keep only the newest K checkpoints")
    resume: str = opt("auto", "auto (newest complete checkpoint in output_dir/checkpoints) | never | a checkpoint path")
    malloc_mmap_threshold_mb: float = opt(0.0, "host blocks of this size and more go back to the OS when freed "
                                               "(glibc): less peak memory, slower steps (host_memory.py); 0 = "
                                               "glibc's adaptive default")
    # guards
    kl_rollback_threshold: float = opt(0.0, "kl/mean above this reloads the last checkpoint with a lower actor lr; 0 = off")
    rollback_lr_factor: float = opt(0.5, "each rollback multiplies the actor's learning rate by this")
    max_rollbacks: int = opt(3, "give up (stop the run) after this many rollbacks")
    max_consecutive_skips: int = opt(5, "roll back after this many optimizer steps in a row skipped for a non-finite "
                                        "gradient norm; 0 = never")
    entropy_warn_threshold: float = opt(0.01, "warn when actor/entropy falls below this (entropy collapse); 0 = off")
    entropy_floor: float = opt(0.0, "react to entropy collapse: when guard/entropy (the policy's entropy at "
                                    "`temperature`) falls below this, switch to entropy_floor_temperature and/or "
                                    "entropy_floor_coeff; 0 = off")
    entropy_floor_temperature: typing.Optional[float] = opt(None, "entropy_floor: the sampling temperature while "
                                                                  "reacting, above temperature to raise entropy "
                                                                  "(e.g. 1.2); None = unchanged")
    entropy_floor_coeff: typing.Optional[float] = opt(None, "entropy_floor: the entropy_coeff while reacting "
                                                            "(e.g. 0.01); None = unchanged")
    entropy_recover: float = opt(0.0, "entropy_floor: undo the reaction once guard/entropy rises above this "
                                      "(> entropy_floor); 0 = keep it for the rest of the run")
    skip_nonfinite_rewards: bool = opt(False, "a NaN/inf score drops that sample from the update instead of stopping the run")
    # tracking
    mlflow_tracking_uri: str = opt("", "MLflow tracking URI; '' = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir")
    mlflow_experiment: str = opt("ppo", "MLflow experiment name")
    run_name: str = opt("", "MLflow run name; '' = the output_dir's name")
    mlflow_system_metrics: bool = opt(False, "MLflow samples CPU, memory (and GPU) use of the machine into the run")
    mlflow_log_model: bool = opt(True, "log the final model to the MLflow run as a transformers model (a few "
                                       "seconds even for a tiny model); it is in output_dir/final either way")
    log_samples: int = opt(16, "validation generations logged to MLflow as a table, per validation")
    peak_tflops: float = opt(0.0, "the device's dense peak TFLOPS at the run's precision, for perf/mfu; 0 = known "
                                  "GPUs by name (flops.py), none on other devices (CPUs): no perf/mfu")
    # rollout
    rollout_engine: str = opt("hf", "hf (generate on the actor itself) | vllm")
    rollout_n: int = opt(4, "responses sampled per prompt")
    rollout_ignore_eos: bool = opt(False, "keep sampling past EOS (fixed-length responses, for benchmarks)")
    rollout_micro_batch_size: int = opt(256, "sequences per generate() call (hf engine)")
    rollout_sleep: bool = opt(True, "vllm: free the engine's weights and KV cache while the models train (GPU)")
    rollout_sleep_level: int = opt(1, "vllm on GPU: 1 = weights to host memory while asleep; 2 = weights dropped "
                                      "(every weight is sent after each update anyway; vLLM has had bugs with 2)")
    rollout_enforce_eager: bool = opt(False, "vllm on GPU: no CUDA graphs (slower decoding, faster start); CPU is "
                                             "always eager")
    rollout_gpu_memory_utilization: float = opt(0.5, "vllm on GPU: share of GPU memory the engine may take")
    rollout_kv_cache_gb: float = opt(1.0, "vllm on CPU: KV cache size in GiB")
    rollout_sync_bucket_mb: float = opt(256.0, "vllm: weight sync gathers ZeRO-3 shards this many MiB at a time")
    rollout_fallback_hf: bool = opt(False, "vllm: if the engine cannot start, generate with the hf engine instead")
    rollout_max_logprob_diff: float = opt(0.0, "react when rollout/logprob_diff (sampler vs actor) exceeds this; "
                                               "0 = never")
    rollout_on_drift: str = opt("stop", "the reaction to rollout_max_logprob_diff: stop (the run, naming the step) | "
                                        "regenerate (re-send the weights and sample that step again with the hf "
                                        "engine, on-policy)")
    rollout_is: str = opt("off", "rollout correction, truncated importance sampling of the sampler against the actor "
                                 "(both under the top_p/top_k cut): off | token | sequence")
    rollout_is_threshold: float = opt(2.0, "rollout_is: the weights' cap C in min(exp(actor - sampler log-prob), C)")
    temperature: float = opt(1.0, "sampling temperature for rollouts; log-probs use the same temperature")
    top_p: float = opt(1.0, "nucleus sampling for rollouts")
    top_k: int = opt(-1, "top-k sampling for rollouts; -1 = off")
    val_temperature: float = opt(0.0, "sampling temperature for validation; 0 = greedy")
    # optimisation
    actor_lr: float = opt(5e-5, "actor learning rate (AdamW)")
    critic_lr: float = opt(1e-4, "critic learning rate (AdamW)")
    weight_decay: float = opt(0.0, "AdamW weight decay, actor and critic")
    lr_warmup_steps: int = opt(0, "linear learning-rate warmup over this many steps (actor and critic)")
    lr_warmup_steps_ratio: float = opt(0.0, "warmup as a fraction of total_training_steps, when lr_warmup_steps is 0 "
                                            "(verl's lr_warmup_steps_ratio)")
    lr_scheduler_type: str = opt("constant", "after warmup: constant | cosine (decays to min_lr_ratio x lr by the last step)")
    min_lr_ratio: float = opt(0.0, "cosine schedule: the final learning rate as a fraction of the initial one")
    max_grad_norm: float = opt(1.0, "actor gradient clipping (global norm)")
    critic_max_grad_norm: float = opt(1.0, "critic gradient clipping (global norm)")
    critic_warmup: int = opt(0, "the actor is updated from step critic_warmup on (verl's meaning: steps before it "
                                "train the critic only; 0 and 1 both update the actor from step 1)")
    ppo_epochs: int = opt(2, "passes over each iteration's rollouts")
    ppo_mini_batch_size: int = opt(32, "prompts per optimizer step (x rollout_n sequences)")
    ppo_micro_batch_size_per_device: int = opt(128, "sequences per forward/backward on one device")
    log_prob_micro_batch_size_per_device: typing.Optional[int] = opt(
        None, "sequences per no-grad forward pass (old and reference log-probs, values; nothing kept for a backward "
              "pass, so it can be larger); None = ppo_micro_batch_size_per_device")
    use_dynamic_bsz: bool = opt(False, "form micro-batches by token budget instead of a sequence count")
    ppo_max_token_len_per_device: int = opt(16384, "use_dynamic_bsz: prompt+response tokens per micro-batch")
    remove_padding: bool = opt(True, "pack each micro-batch's sequences end to end in one row, so no layer computes "
                                     "on padding (verl's use_remove_padding); False = pad them to the longest")
    critic_ppo_mini_batch_size: typing.Optional[int] = opt(None, "critic: prompts per optimizer step; None = ppo_mini_batch_size")
    critic_ppo_micro_batch_size_per_device: typing.Optional[int] = opt(
        None, "critic: sequences per forward/backward on one device; None = ppo_micro_batch_size_per_device")
    critic_ppo_epochs: typing.Optional[int] = opt(None, "critic: passes over each iteration's rollouts; None = ppo_epochs")
    critic_ppo_max_token_len_per_device: typing.Optional[int] = opt(
        None, "critic, use_dynamic_bsz: tokens per micro-batch; None = ppo_max_token_len_per_device")
    gradient_checkpointing: bool = opt(False, "recompute the actor's activations in the backward pass instead of "
                                              "keeping them: less memory, about a third more compute")
    critic_gradient_checkpointing: typing.Optional[bool] = opt(None, "the same for the critic; None = "
                                                                     "gradient_checkpointing")
    ref_offload: bool = opt(False, "DeepSpeed ZeRO-3: keep the reference model's parameters in CPU memory")
    reward_offload: bool = opt(False, "DeepSpeed ZeRO-3: keep the reward model's parameters in CPU memory")
    # advantages and rewards
    adv_estimator: str = opt("gae", "gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline")
    norm_adv_by_std_in_grpo: bool = opt(True, "grpo: divide by the group's std (False = Dr. GRPO)")
    gamma: float = opt(1.0, "discount")
    lam: float = opt(0.95, "GAE lambda")
    use_kl_in_reward: bool = opt(True, "subtract kl_coef * KL(actor || ref) from the token rewards")
    kl_penalty: str = opt("kl", "estimator for KL in the reward: kl/k1, abs, mse/k2, low_var_kl/k3 (+ variants)")
    kl_ctrl_type: str = opt("fixed", "KL-in-reward coefficient: fixed | adaptive")
    kl_coef: float = opt(0.001, "KL-in-reward coefficient (the adaptive controller's initial value)")
    target_kl: float = opt(0.1, "adaptive controller: the KL it steers towards")
    kl_horizon: int = opt(10000, "adaptive controller: horizon (in sequences)")
    use_kl_loss: bool = opt(False, "add kl_loss_coef * KL(actor || ref) to the actor loss")
    kl_loss_coef: float = opt(0.001, "KL-loss coefficient")
    kl_loss_type: str = opt("low_var_kl", "estimator for the KL loss (same names as kl_penalty)")
    # losses
    clip_ratio: float = opt(0.2, "PPO clip range; the default for clip_ratio_low and clip_ratio_high")
    clip_ratio_low: typing.Optional[float] = opt(None, "lower clip range (ratio >= 1 - low); None = clip_ratio")
    clip_ratio_high: typing.Optional[float] = opt(None, "upper clip range (ratio <= 1 + high); None = clip_ratio")
    clip_ratio_c: float = opt(3.0, "dual-clip constant (> 1) bounding the loss where advantages are negative")
    cliprange_value: float = opt(0.5, "value clipping around the old values")
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient")
    loss_agg_mode: str = opt("token-mean", "token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm")


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults <- each --config YAML in order <- --key=value / --key value overrides."""
    argv = sys.argv[1:] if argv is None else argv
    pairs = _parse_cli(argv)
    values: dict = {}
    for key, val in pairs:
        if key == "config":
            values.update(_read_yaml(val))
    for key, val in pairs:
        if key != "config":
            values[key] = val
    cfg = Config(**{k: _coerce(k, v) for k, v in values.items()})
    validate_config(cfg)
    return cfg


def config_warnings(cfg: Config) -> list[str]:
    """Settings that run but are known to work against the user."""
    notes = []
    if cfg.adv_estimator == "grpo" and cfg.norm_adv_by_std_in_grpo and cfg.use_kl_in_reward:
        notes.append("adv_estimator=grpo with use_kl_in_reward=true: a group whose verifier scores tie differs only "
                     "by kl_coef x KL, and dividing by the group's std turns that noise into advantages of about "
                     "+-1 (on the demo: +6 validation points instead of +31). verl's GRPO recipes use "
                     "use_kl_in_reward=false and use_kl_loss=true (configs/demo_grpo.yaml)")
    if cfg.entropy_floor and cfg.entropy_floor_temperature is not None and cfg.entropy_floor_temperature < cfg.temperature:
        notes.append(f"entropy_floor_temperature={cfg.entropy_floor_temperature:g} is below temperature="
                     f"{cfg.temperature:g}: sampling colder lowers entropy, so this reaction to entropy collapse "
                     f"deepens it; a temperature above {cfg.temperature:g} raises it")
    if cfg.entropy_floor and cfg.entropy_floor_coeff is not None and cfg.entropy_floor_coeff < cfg.entropy_coeff:
        notes.append(f"entropy_floor_coeff={cfg.entropy_floor_coeff:g} is below entropy_coeff={cfg.entropy_coeff:g}: "
                     "a smaller entropy bonus lets entropy fall further, so this reaction to entropy collapse "
                     "deepens it")
    return notes


def _parse_cli(argv: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}: use --key=value or --key value")
        if "=" in arg:
            key, val = arg[2:].split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, val, i = arg[2:], argv[i + 1], i + 1
        else:
            raise UserError(f"{arg} has no value: use {arg}=VALUE")
        pairs.append((key.replace("-", "_"), val))
        i += 1
    return pairs


def _read_yaml(path: str) -> dict:
    import yaml
    if not Path(path).is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise UserError(f"config file {path} is not valid YAML{at}: {problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must be a mapping of key: value, got {type(data).__name__}")
    return data


def _coerce(key: str, value):
    hints = typing.get_type_hints(Config)
    if key not in hints:
        close = difflib.get_close_matches(key, list(hints), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"unknown config key {key!r}{hint} (python train_ppo.py --help lists them)")
    kind = hints[key]
    optional = typing.get_origin(kind) is typing.Union
    if optional:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except ValueError:
        raise UserError(f"config key {key!r} expects {kind.__name__}, got {value!r}") from None


def validate_config(cfg: Config) -> None:
    """Everything checkable before a model loads; each message names the key and the value."""
    def need(ok, msg):
        if not ok:
            raise UserError(msg)

    for key in ("train_batch_size", "total_training_steps", "rollout_n", "ppo_epochs", "ppo_mini_batch_size",
                "ppo_micro_batch_size_per_device", "max_prompt_length", "max_response_length", "rollout_micro_batch_size"):
        need(getattr(cfg, key) > 0, f"{key} must be > 0, got {getattr(cfg, key)}")
    need(cfg.clip_ratio_c > 1, f"clip_ratio_c must be > 1, got {cfg.clip_ratio_c}")
    need(cfg.malloc_mmap_threshold_mb >= 0, f"malloc_mmap_threshold_mb must be >= 0, got {cfg.malloc_mmap_threshold_mb}")
    need(cfg.peak_tflops >= 0, f"peak_tflops must be >= 0 (0 = look the device up), got {cfg.peak_tflops}")
    need(cfg.kl_ctrl_type in kl.CONTROLLERS, f"kl_ctrl_type must be one of {sorted(kl.CONTROLLERS)}, got {cfg.kl_ctrl_type!r}")
    if cfg.use_kl_in_reward and cfg.kl_ctrl_type == "adaptive":
        need(cfg.target_kl > 0, f"target_kl must be > 0 with kl_ctrl_type=adaptive, got {cfg.target_kl}")
        need(cfg.kl_horizon > 0, f"kl_horizon must be > 0 with kl_ctrl_type=adaptive, got {cfg.kl_horizon}")
    for key in ("kl_penalty", "kl_loss_type"):
        need(getattr(cfg, key) in kl.kl_estimator_names(),
             f"{key} must be one of {kl.kl_estimator_names()}, got {getattr(cfg, key)!r}")
    need(cfg.adv_estimator in ADV_ESTIMATORS, f"adv_estimator must be one of {ADV_ESTIMATORS}, got {cfg.adv_estimator!r}")
    need(cfg.loss_agg_mode in LOSS_AGG_MODES, f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {cfg.loss_agg_mode!r}")
    need(cfg.dtype in ("fp32", "bf16"), f"dtype must be fp32 or bf16, got {cfg.dtype!r}")
    need(cfg.rollout_engine in ("hf", "vllm"), f"rollout_engine must be hf or vllm, got {cfg.rollout_engine!r}")
    need(cfg.prompt_truncation in ("error", "left", "drop"),
         f"prompt_truncation must be error, left or drop, got {cfg.prompt_truncation!r}")
    need(cfg.temperature > 0, f"temperature must be > 0 for rollouts, got {cfg.temperature}")
    need(cfg.lr_scheduler_type in ("constant", "cosine"),
         f"lr_scheduler_type must be constant or cosine, got {cfg.lr_scheduler_type!r}")
    need(0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    need(0 <= cfg.overlong_buffer_len < cfg.max_response_length,
         f"overlong_buffer_len must be in [0, max_response_length={cfg.max_response_length}), got {cfg.overlong_buffer_len}")
    need(0 < cfg.rollback_lr_factor <= 1, f"rollback_lr_factor must be in (0, 1], got {cfg.rollback_lr_factor}")
    need(cfg.lora_rank >= 0, f"lora_rank must be >= 0, got {cfg.lora_rank}")
    need(not (cfg.lora_rank and cfg.ref_model_path),
         f"lora_rank={cfg.lora_rank} uses the base model (adapters disabled) as the reference: drop ref_model_path")
    need(cfg.save_total_limit > 0, f"save_total_limit must be > 0, got {cfg.save_total_limit}")
    need(cfg.resume in ("auto", "never") or Path(cfg.resume).is_dir(),
         f"resume must be auto, never or a checkpoint directory; {cfg.resume} does not exist")
    need(cfg.val_temperature >= 0, f"val_temperature must be >= 0, got {cfg.val_temperature}")
    need(0 < cfg.top_p <= 1, f"top_p must be in (0, 1], got {cfg.top_p}")
    need(cfg.top_k == -1 or cfg.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {cfg.top_k}")
    for key in ("actor_lr", "critic_lr", "max_grad_norm", "critic_max_grad_norm", "rollout_kv_cache_gb",
                "rollout_sync_bucket_mb", "ppo_max_token_len_per_device"):
        need(getattr(cfg, key) > 0, f"{key} must be > 0, got {getattr(cfg, key)}")
    need(0 <= cfg.lr_warmup_steps_ratio <= 1, f"lr_warmup_steps_ratio must be in [0, 1], got {cfg.lr_warmup_steps_ratio}")
    for key in ("weight_decay", "lr_warmup_steps", "critic_warmup", "kl_coef", "kl_loss_coef", "log_samples",
                "reward_clip"):
        need(getattr(cfg, key) >= 0, f"{key} must be >= 0, got {getattr(cfg, key)}")
    for key in ("gamma", "lam"):
        need(0 <= getattr(cfg, key) <= 1, f"{key} must be in [0, 1], got {getattr(cfg, key)}")
    need(cfg.rollout_on_drift in ("stop", "regenerate"),
         f"rollout_on_drift must be stop or regenerate, got {cfg.rollout_on_drift!r}")
    need(cfg.rollout_is in ("off", "token", "sequence"), f"rollout_is must be off, token or sequence, got {cfg.rollout_is!r}")
    need(cfg.rollout_is_threshold > 0, f"rollout_is_threshold must be > 0, got {cfg.rollout_is_threshold}")
    need(cfg.rollout_sleep_level in (1, 2), f"rollout_sleep_level must be 1 or 2, got {cfg.rollout_sleep_level}")
    need(0 < cfg.rollout_gpu_memory_utilization <= 1,
         f"rollout_gpu_memory_utilization must be in (0, 1], got {cfg.rollout_gpu_memory_utilization}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "cliprange_value"):
        value = getattr(cfg, key)
        need(value is None or value > 0, f"{key} must be > 0, got {value}")
    for key in ("critic_ppo_mini_batch_size", "critic_ppo_micro_batch_size_per_device", "critic_ppo_epochs",
                "critic_ppo_max_token_len_per_device", "log_prob_micro_batch_size_per_device"):
        need(getattr(cfg, key) is None or getattr(cfg, key) > 0, f"{key} must be > 0 (or None), got {getattr(cfg, key)}")
    for role in ("actor", "critic"):
        sched, key = schedule(cfg, role), "ppo_mini_batch_size" if role == "actor" else "critic_ppo_mini_batch_size"
        need(cfg.train_batch_size % sched.mini_batch == 0,
             f"train_batch_size ({cfg.train_batch_size}) must be a multiple of {key} ({sched.mini_batch})")
        need(not cfg.use_dynamic_bsz or sched.max_tokens >= cfg.max_prompt_length + cfg.max_response_length,
             f"{role}'s token budget {sched.max_tokens} must hold one whole sequence (max_prompt_length + "
             f"max_response_length = {cfg.max_prompt_length + cfg.max_response_length})")
    need(cfg.adv_estimator == "gae" or cfg.rollout_n > 1 or cfg.adv_estimator == "reinforce_plus_plus",
         f"adv_estimator={cfg.adv_estimator} compares samples of one prompt: set rollout_n > 1 (got {cfg.rollout_n})")
    need(cfg.reward_fn or cfg.reward_model_path, "set reward_fn ('module:function') or reward_model_path")
    for key in ("model_path", "critic_model_path", "ref_model_path", "reward_model_path"):
        path = getattr(cfg, key)
        need(not path or Path(path).is_dir(), f"{key}: model directory {path} "
             + ("is a file: give the directory that holds config.json" if Path(path).is_file() else "does not exist"))
    if cfg.entropy_floor:
        need(cfg.entropy_floor > 0, f"entropy_floor must be >= 0, got {cfg.entropy_floor}")
        need(cfg.entropy_floor_temperature is not None or cfg.entropy_floor_coeff is not None,
             f"entropy_floor={cfg.entropy_floor} needs a reaction: set entropy_floor_temperature and/or "
             "entropy_floor_coeff")
        need(cfg.entropy_floor_temperature is None or cfg.entropy_floor_temperature > 0,
             f"entropy_floor_temperature must be > 0, got {cfg.entropy_floor_temperature}")
        need(cfg.entropy_recover == 0 or cfg.entropy_recover > cfg.entropy_floor,
             f"entropy_recover ({cfg.entropy_recover}) must be 0 (never) or above entropy_floor ({cfg.entropy_floor})")
    need(cfg.sft_coef >= 0 and cfg.sft_batch_size >= 0,
         f"sft_coef and sft_batch_size must be >= 0, got {cfg.sft_coef} and {cfg.sft_batch_size}")
    for key in ("train_files", "val_files", "sft_files"):
        for path in _split_files(getattr(cfg, key)):
            need(not Path(path).is_dir(), f"{key}: {path} is a directory; give parquet or jsonl files, comma-separated")
            need(Path(path).is_file(), f"{key}: file {path} does not exist")
    need(_split_files(cfg.train_files), "train_files is empty: give at least one parquet or jsonl file")


@dataclass(frozen=True)
class Schedule:
    """How one trained model goes over a step's rollouts; the critic may have its own, as in verl."""
    mini_batch: int      # prompts per optimizer step (all ranks)
    micro_batch: int     # sequences per forward/backward on one device
    epochs: int
    max_tokens: int      # use_dynamic_bsz: tokens per micro-batch; 0 = by sequence count


def schedule(cfg: Config, role: str) -> Schedule:
    """role: actor | critic. A critic_ key left at None takes the actor's value."""
    def own(key):
        value = getattr(cfg, f"critic_{key}") if role == "critic" else None
        return getattr(cfg, key) if value is None else value
    return Schedule(own("ppo_mini_batch_size"), own("ppo_micro_batch_size_per_device"), own("ppo_epochs"),
                    own("ppo_max_token_len_per_device") if cfg.use_dynamic_bsz else 0)


def critic_checkpointing(cfg: Config) -> bool:
    return cfg.gradient_checkpointing if cfg.critic_gradient_checkpointing is None else cfg.critic_gradient_checkpointing


def _split_files(files: str) -> list[str]:
    return [f.strip() for f in files.split(",") if f.strip()]


# ----------------------------------------------------------------------------------------------
# Pure math (verl 0.9.1's definitions, see shared algorithms.md). Tensors in, tensors out.
# B sequences, T response tokens; mask is 1 on real response tokens.
# ----------------------------------------------------------------------------------------------
def masked_sum(values, mask, dim=None):
    # where() rather than values * mask: a nan at a padded position must not leak in
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values, mask, dim=None):
    return masked_sum(values, mask, dim) / ((mask.sum() if dim is None else mask.sum(dim)) + 1e-8)


def masked_var(values, mask):
    """Unbiased variance over the valid positions (a single valid value gets no correction)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return var * torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))


def masked_whiten(values, mask):
    """Zero mean, unit variance over the valid positions; padded positions are shifted too."""
    return (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + 1e-8)


def entropy_from_logits(logits):
    # logsumexp - E_p[logits] == -sum p log p, without materialising log p
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)        # [B, T]


def compute_gae(token_rewards, values, mask, gamma, lam):
    """Generalised advantage estimation over right-padded responses -> (advantages, returns)."""
    with torch.no_grad():
        B, T = token_rewards.shape
        nextv = torch.zeros(B, dtype=values.dtype, device=values.device)         # [B]
        last = torch.zeros_like(nextv)                                            # [B]
        adv = torch.zeros_like(token_rewards)                                     # [B, T]
        for t in reversed(range(T)):
            m = mask[:, t].to(values.dtype)                                       # [B]
            delta = token_rewards[:, t] + gamma * nextv - values[:, t]            # [B]
            new = delta + gamma * lam * last                                      # [B]
            # padded steps pass the carry through unchanged
            nextv = values[:, t] * m + (1 - m) * nextv
            last = new * m + (1 - m) * last
            adv[:, t] = last
        returns = adv + values                                                    # [B, T]
        return masked_whiten(adv, mask), returns


def _group_stats(scores, group_ids, valid=None):
    """Per-sequence (mean, unbiased std, count) of its group's scores, over the group's valid
    samples only (valid [B] bool; None = all): a dropped sample is no part of any baseline."""
    w = torch.ones_like(scores) if valid is None else valid.to(scores.dtype)      # [B]
    scores = torch.where(w > 0, scores, torch.zeros_like(scores))                 # a dropped NaN must not leak
    _, inv = torch.unique(group_ids, return_inverse=True)                         # [B]
    count = torch.zeros(int(inv.max()) + 1, dtype=scores.dtype, device=scores.device).index_add_(0, inv, w)  # [G]
    mean = torch.zeros_like(count).index_add_(0, inv, scores * w) / count.clamp(min=1)                      # [G]
    sq = torch.zeros_like(count).index_add_(0, inv, (scores - mean[inv]) ** 2 * w)                           # [G]
    std = torch.sqrt(sq / (count - 1).clamp(min=1))                               # [G]
    return mean[inv], std[inv], count[inv]                                        # [B] each


def _drop(a, valid):
    """0 for dropped samples (whatever their score was, NaN included)."""
    return a if valid is None else torch.where(valid, a, torch.zeros_like(a))


def compute_grpo_advantages(token_rewards, mask, group_ids, norm_by_std=True, eps=1e-6, valid=None):
    """Score minus its group's mean (over std) -> (advantages, returns), equal. valid [B]: samples
    that count in their group's statistics (None = all)."""
    with torch.no_grad():
        scores = token_rewards.sum(-1)                                            # [B]
        mean, std, n = _group_stats(scores, group_ids, valid)
        mean = torch.where(n > 1, mean, torch.zeros_like(mean))   # a lone sample has no baseline
        std = torch.where(n > 1, std, torch.ones_like(std))
        a = (scores - mean) / (std + eps) if norm_by_std else scores - mean       # [B]
        adv = _drop(a, valid)[:, None] * mask                                                   # [B, T]
        return adv, adv


def compute_rloo_advantages(token_rewards, mask, group_ids, valid=None):
    """Leave-one-out baseline: score minus the mean of the group's other (valid) scores."""
    with torch.no_grad():
        scores = token_rewards.sum(-1)                                            # [B]
        mean, _, n = _group_stats(scores, group_ids, valid)
        k = n / (n - 1).clamp(min=1)
        a = torch.where(n > 1, scores * k - mean * k, scores)                     # [B]
        adv = _drop(a, valid)[:, None] * mask                                                   # [B, T]
        return adv, adv


def compute_reinforce_pp_advantages(token_rewards, mask, gamma):
    """REINFORCE++: discounted return-to-go, whitened over the batch."""
    with torch.no_grad():
        returns = torch.zeros_like(token_rewards)                                 # [B, T]
        running = torch.zeros_like(token_rewards[:, 0])                           # [B]
        for t in reversed(range(token_rewards.shape[1])):
            m = mask[:, t].to(token_rewards.dtype)
            new = token_rewards[:, t] + gamma * running
            returns[:, t] = new * m
            running = new * m + running * (1 - m)
        adv = masked_whiten(returns, mask) * mask                                 # [B, T]
        return adv, returns


def compute_reinforce_pp_baseline_advantages(token_rewards, mask, group_ids, valid=None):
    """REINFORCE++ with a group-mean baseline (over the group's valid samples), whitened over the batch."""
    with torch.no_grad():
        scores = token_rewards.sum(-1)                                            # [B]
        mean, _, n = _group_stats(scores, group_ids, valid)
        scores = scores - torch.where(n > 1, mean, torch.zeros_like(mean))
        x = _drop(scores, valid)[:, None] * mask                                                # [B, T]
        adv = masked_whiten(x, mask) * mask                                       # [B, T]
        return adv, adv


def agg_loss(loss_mat, mask, loss_agg_mode, num_tokens=None, num_seqs=None, seq_len=None):
    """Reduce a [B, T] loss to a scalar. num_tokens / num_seqs override the denominators (the
    whole mini-batch's counts, across micro-batches and ranks, so the pieces sum to the mini-batch
    loss); seq_len overrides T for seq-mean-token-sum-norm."""
    mask = mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return masked_sum(loss_mat, mask) / denom
    seq_sum = masked_sum(loss_mat, mask, dim=-1)                                  # [B]
    nonempty = (mask.sum(-1) > 0).to(loss_mat.dtype)                              # [B]
    n_seqs = nonempty.sum() if num_seqs is None else num_seqs
    if loss_agg_mode == "seq-mean-token-sum":
        return (seq_sum * nonempty).sum() / n_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sum / (mask.sum(-1) + 1e-8) * nonempty).sum() / n_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        width = mask.shape[-1] if seq_len is None else seq_len
        return (seq_sum * nonempty).sum() / n_seqs / width
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def policy_loss(old_logprob, logprob, advantages, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                loss_agg_mode, is_weights=None, **agg):
    """Clipped surrogate with dual-clip -> (loss, {pg_clipfrac, ppo_kl, pg_clipfrac_lower}).
    is_weights [B, T]: rollout-correction weights (detached) multiplying each token's loss."""
    log_ratio = torch.clamp(logprob - old_logprob, -20.0, 20.0)                    # [B, T]
    ratio = torch.exp(log_ratio)                                                  # [B, T]
    ppo_kl = masked_mean(-log_ratio, mask)
    loss1 = -advantages * ratio                                                   # [B, T]
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)                                         # [B, T]
    pg_clipfrac = masked_mean((loss2 > loss1).float(), mask)
    # dual clip: with A < 0 a huge ratio would make the loss unbounded; cap it at -A * c
    loss3 = -advantages * clip_ratio_c                                            # [B, T]
    dual = torch.minimum(loss3, clipped)
    pg_clipfrac_lower = masked_mean(((clipped > loss3) & (advantages < 0)).float(), mask)
    per_token = torch.where(advantages < 0, dual, clipped)                        # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = agg_loss(per_token, mask, loss_agg_mode, **agg)
    return loss, {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}


def rollout_is_weights(old_logprob, sampler_logprob, mask, mode, threshold):
    """Truncated importance sampling of the sampler against the actor (the sampler's log-probs
    differ from the actor's: bf16, kernels, versions) -> (weights [B, T], {mean, max, clipped_frac}).
    token: w_t = min(exp(old_t - sampler_t), C); sequence: one weight per sequence,
    min(exp(sum_t (old_t - sampler_t)), C), on each of its tokens. No gradient flows through."""
    with torch.no_grad():
        log_w = (old_logprob - sampler_logprob) * mask                            # [B, T]
        if mode == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)                  # [B, T]
        raw = torch.exp(log_w.clamp(max=20.0))                                    # [B, T]
        weights = torch.clamp(raw, max=threshold) * mask                          # [B, T]
        stats = {"weight_mean": masked_mean(weights, mask),
                 "weight_max": torch.where(mask.bool(), weights, torch.zeros_like(weights)).max(),
                 "clipped_frac": masked_mean((raw > threshold).float(), mask)}
        return weights, stats


def value_loss(vpreds, returns, values, mask, cliprange_value, loss_agg_mode, **agg):
    """Clipped value loss -> (loss, vf_clipfrac)."""
    vclip = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # [B, T]
    err = (vpreds - returns) ** 2                                                 # [B, T]
    err_clip = (vclip - returns) ** 2                                             # [B, T]
    loss = 0.5 * agg_loss(torch.maximum(err, err_clip), mask, loss_agg_mode, **agg)
    return loss, masked_mean((err_clip > err).float(), mask)


def overlong_penalty(lengths, max_response_length, buffer_len, penalty_factor):
    """DAPO overlong shaping -> [B]: 0 up to max_response_length - buffer_len, then linearly down
    to -penalty_factor at max_response_length."""
    expected = max_response_length - buffer_len
    return torch.clamp(-(lengths - expected) / buffer_len * penalty_factor, max=0.0)


def lr_factor(step, warmup_steps, total_steps, schedule, min_lr_ratio):
    """Learning-rate multiplier at a step (0-based): linear warmup, then constant or a half-cosine
    from 1 down to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def token_budget_splits(lengths: list[int], max_tokens: int, n_groups: int = 0) -> list[list[int]]:
    """Groups of sequence indices whose total length stays within max_tokens (a longer sequence
    goes alone): micro-batches by token count rather than sequence count. Longest first, each into
    the first group with room (first-fit decreasing). With n_groups above the number needed, the
    fullest groups are halved until there are exactly n_groups: under ZeRO-3 every rank must run
    as many forward passes as the others. Indices ascend within a group."""
    if n_groups > len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {n_groups} non-empty groups")
    groups: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        room = next((g for g, u in enumerate(used) if u + lengths[i] <= max_tokens), None)
        if room is None:
            groups.append([])
            used.append(0)
            room = len(groups) - 1
        groups[room].append(i)
        used[room] += lengths[i]
    while len(groups) < n_groups:
        fullest = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: used[g])
        members = sorted(groups[fullest], key=lambda i: -lengths[i])
        groups[fullest], half = members[0::2], members[1::2]
        used[fullest] = sum(lengths[i] for i in groups[fullest])
        groups.append(half)
        used.append(sum(lengths[i] for i in half))
    return [sorted(g) for g in groups]


def explained_variance(returns, values, mask):
    return 1 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)


def kl_in_reward(token_scores, old_logprob, ref_logprob, mask, beta, estimator):
    """Token rewards = scores - beta * KL -> (token_rewards, current_kl: mean over sequences of
    each sequence's mean KL, what the adaptive controller steers on)."""
    kld = kl.kl_penalty(old_logprob, ref_logprob, estimator) * mask               # [B, T]
    token_rewards = token_scores - beta * kld                                     # [B, T]
    current_kl = masked_mean(kld, mask, dim=-1).mean()
    return token_rewards, current_kl


# ----------------------------------------------------------------------------------------------
# Models and data.
# ----------------------------------------------------------------------------------------------
def read_table(path: str):
    """A parquet or jsonl file as a DataFrame with at least one row; problems name the file."""
    import pandas as pd
    if not Path(path).is_file():
        raise UserError(f"{path}: no such file")
    if not path.endswith((".parquet", ".jsonl", ".json")):
        raise UserError(f"{path}: unsupported file type (use .parquet or .jsonl)")
    kind = "parquet" if path.endswith(".parquet") else "JSON lines"
    try:
        frame = pd.read_parquet(path) if kind == "parquet" else _read_json_lines(path)
    except UserError:
        raise
    except Exception as e:   # pyarrow and pandas raise many types for a damaged file
        raise UserError(f"{path}: cannot be read as {kind}: {first_line(e)}") from None
    if len(frame) == 0:
        raise UserError(f"{path}: the file has no rows")
    return frame


def _read_json_lines(path: str):
    """One JSON object per line; a line that is not one is named by its number."""
    import pandas as pd
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}: line {number} is not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}: line {number} is a JSON {type(row).__name__}, not an object of columns")
            rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class PromptSet:
    texts: list[str]                 # the prompt as the model sees it (chat template applied)
    ids: list[list[int]]             # its token ids
    columns: dict[str, list]         # other dataset columns the reward function asks for (e.g. ground_truth)

    def take(self, idx, repeat: int = 1) -> "PromptSet":
        """Rows idx, each repeated `repeat` times in place (one per sampled response)."""
        pick = lambda values: [values[i] for i in idx for _ in range(repeat)]   # noqa: E731
        return PromptSet(pick(self.texts), pick(self.ids), {k: pick(v) for k, v in self.columns.items()})


def load_prompts(files: str, key: str, tokenizer, max_len: int, truncation: str, columns=(), reward_fn="") -> PromptSet:
    """Prompts from parquet/jsonl files, tokenized; every problem names the file (and row)."""
    out = PromptSet([], [], {c: [] for c in columns})
    for path in _split_files(files):
        frame = read_table(path)
        if key not in frame.columns:
            raise UserError(f"{path}: no column {key!r} (prompt_key); its columns are {list(frame.columns)}")
        for column in columns:
            if column not in frame.columns:
                raise UserError(f"{path}: no column {column!r}, which reward_fn {reward_fn} takes; its columns are "
                                f"{list(frame.columns)}")
        kept = []
        for row, prompt in enumerate(frame[key]):
            text = _render_prompt(prompt, tokenizer, path, row, f"{key!r} (prompt_key)")
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not tokens and text.strip():
                raise UserError(f"{path}: row {row}: the tokenizer of model_path turns the prompt {text[:60]!r} into no "
                                "tokens (its vocabulary does not cover this text): check model_path's tokenizer files")
            if not tokens:
                raise UserError(f"{path}: row {row} has an empty prompt")
            if len(tokens) > max_len:
                if truncation == "drop":
                    continue
                if truncation != "left":
                    raise UserError(f"{path}: row {row} has a prompt of {len(tokens)} tokens > max_prompt_length="
                                    f"{max_len} (raise it, or set prompt_truncation=left or drop)")
                tokens = tokens[-max_len:]
            kept.append(row)
            out.texts.append(text)
            out.ids.append(tokens)
        for column in columns:
            values = frame[column].tolist()
            out.columns[column] += [values[i] for i in kept]
        if len(kept) < len(frame):
            print(f"{path}: {len(frame) - len(kept)} of {len(frame)} prompts are longer than max_prompt_length="
                  f"{max_len} and left out (prompt_truncation=drop)", file=sys.stderr, flush=True)
            if not kept:
                raise UserError(f"{path}: every prompt is longer than max_prompt_length={max_len}")
    return out


def load_sft(cfg: Config, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """SFT pairs from parquet/jsonl files -> (prompt ids, response ids + EOS), held to the rollout's
    limits (max_prompt_length, max_response_length); every problem names the file and row."""
    prompts, responses = [], []
    for path in _split_files(cfg.sft_files):
        frame = read_table(path)
        for key, column in (("sft_prompt_key", cfg.sft_prompt_key), ("sft_response_key", cfg.sft_response_key)):
            if column not in frame.columns:
                raise UserError(f"{path}: no column {column!r} ({key}); its columns are {list(frame.columns)}")
        for row, (prompt, response) in enumerate(zip(frame[cfg.sft_prompt_key], frame[cfg.sft_response_key])):
            p = tokenizer(_render_prompt(prompt, tokenizer, path, row, f"{cfg.sft_prompt_key!r} (sft_prompt_key)"),
                          add_special_tokens=False)["input_ids"]
            if not isinstance(response, str) or not response:
                raise UserError(f"{path}: row {row}: the SFT response must be a non-empty string, got {response!r}")
            r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for what, n, key in (("prompt", len(p), "max_prompt_length"), ("response (with EOS)", len(r),
                                                                          "max_response_length")):
                if n == 0 or n > getattr(cfg, key):
                    raise UserError(f"{path}: row {row} has an SFT {what} of {n} tokens; it must have 1 to "
                                    f"{key}={getattr(cfg, key)}")
            prompts.append(p)
            responses.append(r)
    return prompts, responses


def _render_prompt(prompt, tokenizer, path, row, column: str = "the prompt column") -> str:
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{path}: row {row} is a list of chat messages, but the tokenizer of model_path has no "
                            f"chat template to render them: give plain-string prompts or a model with one")
        try:
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise UserError(f"{path}: row {row}: the chat template cannot render these messages: {e}") from None
    raise UserError(f"{path}: row {row}: a prompt must be a string or a list of chat messages, got "
                    f"{type(prompt).__name__} {prompt!r:.40} in column {column}")


def load_reward_fn(spec: str):
    if ":" not in spec:
        raise UserError(f"reward_fn must look like 'module:function', got {spec!r}")
    module, name = spec.split(":", 1)
    sys.path.insert(0, str(HERE))   # rewards/ ships next to this file
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise UserError(f"reward_fn {spec!r}: no module named {e.name!r} on the Python path (this repository and "
                            f"PYTHONPATH): add the module's directory to PYTHONPATH") from None
        raise UserError(f"reward_fn {spec!r}: importing {module} raised {_raised_at(e, module)}") from None
    except Exception as e:   # the user's code runs at import: a SyntaxError, or anything it raises
        raise UserError(f"reward_fn {spec!r}: importing {module} raised {_raised_at(e, module)}") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise UserError(f"reward_fn {spec!r}: module {module} ({getattr(mod, '__file__', '?')}) has no {name!r}")
    if not callable(fn):
        raise UserError(f"reward_fn {spec!r}: {module}.{name} = {fn!r:.40} is not a function")
    import inspect
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):   # some builtins have none to check
        return fn
    try:   # called as fn(prompts, responses, **columns): refused now rather than after the first rollout
        signature.bind([], [], **{column: [] for column in reward_fn_columns(fn)})
    except TypeError as e:
        raise UserError(f"reward_fn {spec!r}: {name}{signature} cannot be called as {name}(prompts, responses, "
                        f"<dataset columns as keywords>): {e}") from None
    return fn


def _raised_at(e: BaseException, module: str) -> str:
    """'Type: message (file, line N)': where the import raised, in the module's own file if it
    appears in the traceback (else the innermost frame)."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    own = module.replace(".", os.sep)
    mine = [f for f in frames if f.filename.endswith((own + ".py", os.path.join(own, "__init__.py")))]
    at = (mine or frames)[-1:]
    return f"{type(e).__name__}: {first_line(e)}" + (f" ({at[0].filename}, line {at[0].lineno})" if at else "")


def reward_fn_columns(fn) -> list[str]:
    """A reward function's parameters after (prompts, responses) name dataset columns it needs."""
    import inspect
    params = list(inspect.signature(fn).parameters.values())[2:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def score_with_fn(fn, spec: str, prompts: list[str], responses: list[str], columns: dict,
                  allow_nonfinite: bool = False) -> torch.Tensor:
    """One finite float per sample, or a UserError naming the sample (with allow_nonfinite, NaN/inf
    pass through for the caller to drop)."""
    try:
        scores = list(fn(prompts, responses, **columns))
    except Exception as e:
        raise UserError(f"reward_fn {spec} raised {type(e).__name__}: {e} (batch of {len(prompts)}, first prompt "
                        f"{prompts[0]!r}, response {responses[0]!r})") from e
    if len(scores) != len(prompts):
        raise UserError(f"reward_fn {spec} returned {len(scores)} scores for {len(prompts)} samples")
    for i, s in enumerate(scores):
        if not isinstance(s, (int, float)) or not (math.isfinite(s) or allow_nonfinite):
            raise UserError(f"reward_fn {spec} returned {s!r} for sample {i}: prompt {prompts[i]!r}, "
                            f"response {responses[i]!r}")
    return torch.tensor(scores, dtype=torch.float32)


def pack_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict:
    """Prompts left-padded to P, responses right-padded to R: one [B, P + R] sequence each."""
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    R = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)                  # [B, P+R]
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)                    # [B, P+R]
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, P - len(p):P + len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                   # [B, P+R]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": input_ids[:, P:], "response_mask": attention_mask[:, P:].float()}   # [B, R]


def select(batch: dict, idx) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def response_logprobs(model, batch: dict, temperature: float, with_entropy: bool = False,
                      entropy_grad: bool = False, truncation: tuple[int, float] | None = None):
    """Log-prob (and entropy) of each response token under `model` -> [B, R] each; with
    truncation=(top_k, top_p) also, third, the log-prob under the distribution a sampler with those
    settings draws from (cut and renormalised, no grad), from the same forward pass.
    Only the B x R positions that predict response tokens reach the LM head. There the chunked
    head_logprobs takes the head's input and computes both without ever holding the [B, R, V]
    logits; the head itself is handed an empty input, and the model's own logit scale and soft-cap
    (load_models' head_transform) are applied there. Where that cannot be done (a head with a bias
    or an adapter, other post-processing of the logits, or ZeRO-3, whose partitioned weight exists
    only inside the head's own forward) the logits are made and reduced one sequence at a time. The entropy builds a graph
    only when it is part of the loss (entropy_grad)."""
    B, R = batch["responses"].shape
    head = _unwrap(model).get_output_embeddings()
    transform = getattr(_unwrap(model), "head_transform", (1.0, None))    # set by load_models
    fused = (transform is not None and type(head) is torch.nn.Linear and head.bias is None
             and not hasattr(head.weight, "ds_id"))
    captured = []
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]) or (args[0][:, :0],)) \
        if fused else None
    try:
        packed = _packed(model, batch)
        W = batch["input_ids"].shape[1]
        keep = (packed.response_index.reshape(-1) if packed is not None         # [B * R] or [R]
                else torch.arange(W - R - 1, W - 1, device=batch["input_ids"].device))
        out = _forward(model, batch, packed, logits_to_keep=keep)
    finally:
        if hook is not None:
            hook.remove()
    if fused:
        hidden = captured[0]                                                      # [B, R, H] or [1, B * R, H]
        logprob, entropy = head_logprobs(hidden.reshape(B * R, -1), head.weight, batch["responses"].reshape(-1),
                                         temperature, *transform)
        logprob, entropy = logprob.view(B, R), entropy.view(B, R)
        entropy = (entropy if entropy_grad else entropy.detach()) if with_entropy else None
        if truncation is None:
            return logprob, entropy
        truncated = truncated_logprobs(hidden.reshape(B * R, -1), head.weight, batch["responses"].reshape(-1),
                                       temperature, *truncation, *transform)
        return logprob, entropy, truncated.view(B, R)
    logits = out.logits.view(B, R, -1)                                            # [B, R, V]
    logprob = torch.stack([_token_logprobs(_scaled(row, temperature), tokens)
                           for row, tokens in zip(logits, batch["responses"])])  # [B, R]
    entropy = None
    if with_entropy:
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = torch.stack([entropy_from_logits(_scaled(row, temperature)) for row in logits])  # [B, R]
    if truncation is None:
        return logprob, entropy
    with torch.no_grad():
        truncated = torch.stack([support_logprobs(_scaled(row, temperature), tokens, *truncation)
                                 for row, tokens in zip(logits, batch["responses"])])  # [B, R]
    return logprob, entropy, truncated


@torch.no_grad()
def head_transform(model):
    """-> ((scale, softcap), None) when head_logprobs, fed the LM head's input with that scale and
    soft-cap, gives `model`'s own logits; (None, why) when it cannot (another post-processing, a
    head that is not a bias-free linear layer). Decided once at load on a short sequence; the
    plain path, which reads the model's own logits, serves the rest."""
    model = _unwrap(model)
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None, "its LM head is not a bias-free linear layer"
    if hasattr(head.weight, "ds_id"):   # partitioned at load (ZeRO-3 init): the plain path reads the model's own logits
        return None, None
    config = model.config.get_text_config()
    scale = float(getattr(config, "logit_scale", None) or 1.0)                      # Cohere: multiplies
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)                  # Granite: divides
    softcap = getattr(config, "final_logit_softcapping", None)                      # Gemma 2/3
    captured = []
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        ids = torch.arange(3, 11, device=head.weight.device)[None] % head.weight.shape[0]   # [1, 8]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()                     # [8, V]
    finally:
        hook.remove()
    mine = captured[-1][0].float() @ head.weight.float().t() * scale                       # [8, V]
    if softcap is not None:
        mine = torch.tanh(mine / softcap) * softcap
    error = float((mine - logits).abs().max()) / max(1.0, float(logits.abs().max()))
    if error <= (1e-4 if head.weight.dtype == torch.float32 else 2e-2):
        return (scale, softcap), None
    return None, f"its forward post-processes the logits in a way the chunked head does not (difference {error:.2g})"


def _packed(model, batch: dict):
    """The micro-batch packed into one row (packing.Packed), or None to run it padded: packed when
    `model`'s attention keeps the sequences of a row apart and packing drops enough padding to pay
    (every rank runs one pass either way)."""
    if _unwrap(model).config._attn_implementation in packing.PACKED_ATTENTION and packing.worth_it(batch):
        return packing.pack(batch)
    return None


def _forward(model, batch: dict, packed, **kwargs):
    """model on a micro-batch: packed into one row (`packed`, from packing.pack), or padded."""
    if packed is None:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False, **kwargs)
    with packing.attention():
        return model(**packed.model_inputs(), use_cache=False, **kwargs)


def _unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine, a DDP wrapper or a PEFT model."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _token_logprobs(logits, tokens):
    # gather minus logsumexp (verl's form): no [R, V] log-softmax output is made
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)   # [R]


def _scaled(logits, temperature: float):
    logits = logits.float()                                                       # a no-op in fp32
    return logits if temperature == 1.0 else logits / temperature


def critic_values(critic, batch: dict):
    """V(s_t) for the state before each response token -> [B, R]."""
    R = batch["responses"].shape[1]
    packed = _packed(critic, batch)
    out = _forward(critic, batch, packed)
    if packed is not None:
        return out.logits[0, packed.response_index, 0].float()                    # [B, R]
    return out.logits[:, -R - 1:-1, 0].float()                                    # [B, R]


def reward_model_scores(reward_model, batch: dict):
    """The reward model's score of each whole sequence, read at its last real token by position
    (the attention mask), where it was trained to score -> [B]. Hugging Face's sequence
    classifiers find that token through pad_token_id instead, which with pad == EOS reads the
    token before the EOS; so the head's per-token output is taken from a hook."""
    head = _unwrap(reward_model).score                                            # the classifier head
    captured = []
    hook = head.register_forward_hook(lambda module, args, out: captured.append(out))
    packed = _packed(reward_model, batch)
    try:
        _forward(reward_model, batch, packed)
    finally:
        hook.remove()
    per_token = captured[0][..., 0].float()                                       # [B, W] or [1, T]
    if packed is not None:
        return per_token[0, packed.last_index]                                    # [B]
    mask = batch["attention_mask"]
    positions = torch.arange(mask.shape[1], device=mask.device)                   # [W]
    last = (positions * mask).argmax(-1)                                          # [B]
    return per_token[torch.arange(mask.shape[0], device=mask.device), last]      # [B]


SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")   # [B, P + R]; every other 2-d entry is [B, R]


def trim_padding(batch: dict) -> dict:
    """Drop the columns every row pads: left of the longest prompt and right of the longest
    response, so a micro-batch computes on its own width, not the whole batch's."""
    R = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - R
    attn = batch["attention_mask"]
    used = attn[:, :P].any(0)                                                      # [P]
    left = int(used.float().argmax()) if used.any() else P
    r = max(1, int(attn[:, P:].sum(-1).max()))
    return {k: v[:, left:P + r] if k in SEQUENCE_KEYS else v[:, :r] if v.dim() > 1 else v for k, v in batch.items()}


def mini_batches(batch: dict, size: int):
    n = batch["input_ids"].shape[0]
    for start in range(0, n, size):
        yield select(batch, slice(start, start + size))


def micro_batches(batch: dict, size: int, max_tokens: int = 0, agree=None) -> list[tuple[torch.Tensor, dict]]:
    """-> [(row indices, micro-batch)]: `size` sequences of similar length each, or with
    max_tokens > 0 groups within that token budget, each trimmed to its own longest sequence. agree(count) -> the count
    every rank uses (the max over ranks): token budgets split each rank's sequences differently,
    and under ZeRO-3 a rank running one pass fewer than the others would hang them."""
    n = batch["input_ids"].shape[0]
    if max_tokens > 0:
        lengths = batch["attention_mask"].sum(-1).tolist()
        groups = token_budget_splits(lengths, max_tokens)
        wanted = agree(len(groups)) if agree else len(groups)
        if wanted > len(groups):   # another rank needs more passes: split to match
            groups = token_budget_splits(lengths, max_tokens, wanted)
        parts = [torch.tensor(g) for g in groups]
    else:   # similar lengths together, so trimming leaves little padding
        order = torch.argsort(batch["attention_mask"].sum(-1), stable=True)       # [n]
        parts = [order[start:start + size] for start in range(0, n, size)]
    return [(idx, trim_padding(select(batch, idx))) for idx in parts]


@torch.no_grad()
def forward_in_micro_batches(fn, batch: dict, size: int, max_tokens: int = 0, agree=None) -> torch.Tensor:
    """fn on each micro-batch, the rows put back in batch order -> [B] or [B, R, ...] (zeros where a
    trimmed micro-batch had no column)."""
    out = None
    for idx, mb in micro_batches(batch, size, max_tokens, agree):
        part = fn(mb)                                                             # [b] or [b, r, ...]
        if out is None:
            shape = (batch["input_ids"].shape[0],) + ((batch["responses"].shape[1], *part.shape[2:])
                                                      if part.dim() > 1 else ())
            out = torch.zeros(shape, dtype=part.dtype, device=part.device)
        if part.dim() > 1:
            out[idx.to(part.device), :part.shape[1]] = part
        else:
            out[idx.to(part.device)] = part
    return out


# model type -> why no path here computes its log-probs right yet; load_models refuses these by name
# (tests/test_conformance.py proves every other family of the registry; README lists these)
REFUSED: dict[str, str] = {
    "rwkv": "it takes no attention mask, so its recurrent state runs through a batch's left padding (1.8 nats off "
            "on a left-padded row of its own forward; a right-padded row is exact) and through a packed row's "
            "neighbours",
    "xlstm": "its recurrent state runs through a batch's left padding (its own forward on a left-padded row is "
             "1.9 nats from the sequence alone; a right-padded row is exact)",
    "recurrent_gemma": "its log-probs match its own per-sequence forward (5e-7) but the gradients of its recurrent "
                       "block differ by up to 0.035 (linear_x.bias), padded and packed; not yet diagnosed",
    "cpmant": "its own forward on a right-padded row differs from the sequence alone by 43 nats (its attention "
              "reads the pad tokens after a sequence), and batches pad responses on the right",
    "deepseek_v4": "its compressed attention reads a batch's left padding (0.25 nats off on a left-padded row of "
                   "its own forward, even with the attention mask and positions; a right-padded row is exact)",
    "trocr": "its forward ignores position_ids (learned positions count the left padding: 0.57 nats off on a "
             "left-padded row of its own forward) and logits_to_keep",
    "hy_v4": "its own forward on a padded batch differs from each sequence alone by up to 0.009 nats, left- or "
             "right-padded (pad tokens change the other tokens' outputs)",
}


def load_models(cfg: Config):
    lean_imports.skip_unused()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = load_tokenizer(cfg.model_path, AutoTokenizer)
    # weights stay fp32 for the trained models (bf16 runs under autocast); frozen ones may be bf16
    frozen_dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    actor = _load("model_path", cfg.model_path, AutoModelForCausalLM.from_pretrained, dtype=torch.float32)
    family = actor.config.model_type
    if family in REFUSED:
        raise UserError(f"model_path: {family} models are not supported: {REFUSED[family]}")
    ends = getattr(actor.generation_config, "eos_token_id", None)
    ends = [ends] if isinstance(ends, int) else list(ends or [])
    if ends and tokenizer.eos_token_id not in ends:   # e.g. a tokenizer class's default EOS, added as a new token
        print(f"warning: model_path: responses end at the tokenizer's EOS {tokenizer.eos_token!r} (id "
              f"{tokenizer.eos_token_id}), which is not the model's (generation_config eos_token_id={ends}): set "
              f"eos_token in {cfg.model_path}/tokenizer_config.json if the model was trained to end with another",
              file=sys.stderr, flush=True)
    if cfg.lora_rank:
        actor = _with_lora(actor, cfg)
    ref = None
    if (cfg.use_kl_in_reward or cfg.use_kl_loss) and not cfg.lora_rank:
        ref = _load("ref_model_path" if cfg.ref_model_path else "model_path", cfg.ref_model_path or cfg.model_path,
                    AutoModelForCausalLM.from_pretrained, dtype=frozen_dtype)
        ref.requires_grad_(False)
    critic = None
    if cfg.adv_estimator == "gae":
        key = "critic_model_path" if cfg.critic_model_path else "model_path"
        with console.expected_missing_weights():   # the value head is new: its absence is no news
            critic, missing = _load(key, cfg.critic_model_path or cfg.model_path, value_models.load_value_model,
                                    dtype=torch.float32, config_key=key)
        if missing:
            print(f"warning: {key}: the critic's backbone lacks {len(missing)} weights, initialised at random: "
                  f"{missing[:5]}", file=sys.stderr, flush=True)
        critic.config.pad_token_id = tokenizer.pad_token_id
    reward_model = None
    if cfg.reward_model_path:
        with console.expected_missing_weights():   # a sequence classifier's head has no bias: zero, as it scored
            reward_model, missing = _load("reward_model_path", cfg.reward_model_path, value_models.load_value_model,
                                          dtype=frozen_dtype, config_key="reward_model_path", head_required=True)
        if missing:
            raise UserError(f"reward_model_path: {cfg.reward_model_path} lacks {len(missing)} of the reward model's "
                            f"weights ({missing[:3]}); they would be random")
        reward_model.config.pad_token_id = tokenizer.pad_token_id
        reward_model.requires_grad_(False)
    for key, model in (("model_path", actor), ("critic_model_path", critic), ("ref_model_path", ref),
                       ("reward_model_path", reward_model)):
        if model is not None:
            _check_fits_model(cfg, key if getattr(cfg, key) else "model_path", model.config, len(tokenizer))
    # dropout off in every model, trained ones too (TRL's PPO does the same): PPO's ratio compares
    # two forward passes of the same weights, which dropout would make differ. Not left to the
    # loaders: PEFT's get_peft_model returns a model in training mode
    for model in (actor, critic, ref, reward_model):
        if model is not None:
            model.eval()
    if cfg.remove_padding:   # packed micro-batches: SDPA once per sequence (flash-attention packs by itself)
        verdicts = {}   # one probe per architecture: actor and ref share theirs
        for model in (actor, critic, ref, reward_model):
            if model is not None and model.config._attn_implementation == "sdpa":
                model.set_attn_implementation(packing.register())
                kind = (type(model), model.config.model_type)
                # parameters partitioned at load (ZeRO-3 init) cannot run a probe: the family's conformance test stands
                partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
                if kind not in verdicts and not partitioned:
                    verdicts[kind] = packing.unpackable(model, atol=1e-3 if model.dtype == torch.float32 else 3e-2)
                    if verdicts[kind]:
                        console.note(f"remove_padding: {type(model).__name__} runs padded micro-batches: {verdicts[kind]}")
                if verdicts.get(kind):
                    model.set_attn_implementation("sdpa")
    for model in (actor, critic, ref, reward_model):
        # Transformers' SDPA drops attention soft-capping (Gemma 2): eager keeps it where the padded path runs on SDPA
        capped = model is not None and getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
        if capped and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation("eager")
    for model in (actor, ref):
        if model is not None:
            transform, why = head_transform(model)
            _unwrap(model).head_transform = transform
            if why and model is actor:
                console.note(f"the chunked LM head is off for {type(_unwrap(model)).__name__}: {why}")
    for model, on in ((actor, cfg.gradient_checkpointing), (critic, critic_checkpointing(cfg))):
        if model is not None and on:   # armed here, active only inside recompute_activations()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return tokenizer, actor, critic, ref, reward_model


@contextmanager
def recompute_activations(model, on: bool):
    """Gradient checkpointing for the length of an update. Hugging Face checkpoints a decoder layer
    only when that layer is in training mode, and every model here stays in eval mode (dropout
    off), so only the layers' own flag is raised meanwhile; their submodules, dropout included,
    stay in eval."""
    if not on:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(path: str, auto_tokenizer):
    """model_path's tokenizer, with a pad token (EOS when it has none). Without tokenizer files
    transformers builds an empty one from config.json's model type, which turns every prompt into
    no tokens; without EOS no response could end: both are refused here, naming the directory."""
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model_path: {path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy "
                        "them from the model the weights come from")
    tokenizer = _load("model_path", path, auto_tokenizer.from_pretrained, "tokenizer")
    if tokenizer.eos_token_id is None:
        raise UserError(f"model_path: the tokenizer in {path} has no EOS token, so no response could end: set "
                        "eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _with_lora(actor, cfg: Config):
    """The actor wrapped in PEFT LoRA adapters. PEFT ignores a listed name that matches nothing as
    long as another one matches (a typo then trains fewer modules than asked, silently): every name
    must match a module."""
    from peft import LoraConfig, get_peft_model
    targets = cfg.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
        names = [n for n, _ in actor.named_modules()]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in actor.named_modules() if isinstance(m, torch.nn.Linear)})
            raise UserError(f"lora_target_modules: {cfg.model_path} has no module named {', '.join(missing)}; its "
                            f"linear layers are {', '.join(linear)} (or use all-linear)")
    try:
        return get_peft_model(actor, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                                                lora_dropout=0.0, task_type="CAUSAL_LM"))
    except Exception as e:   # PEFT raises ValueError (and its own types) for modules it cannot wrap
        raise UserError(f"lora_target_modules={cfg.lora_target_modules}: PEFT cannot add LoRA adapters to "
                        f"{cfg.model_path}: {first_line(e)}") from None


def _check_fits_model(cfg: Config, key: str, config, vocab: int) -> None:
    """A sequence (prompt + response) must fit the model's positions; vLLM refuses it naming only
    its own max_model_len, and models with learned positions fail inside the forward pass."""
    positions = getattr(config, "max_position_embeddings", None)
    length = cfg.max_prompt_length + cfg.max_response_length
    if isinstance(positions, int) and 0 < positions < length:   # -1: no limit (XLNet)
        raise UserError(f"max_prompt_length + max_response_length = {cfg.max_prompt_length} + "
                        f"{cfg.max_response_length} = {length} > max_position_embeddings={positions} of {key} "
                        f"{getattr(cfg, key)} (config.json): lower max_response_length or max_prompt_length")
    rows = getattr(config, "vocab_size", None)
    if isinstance(rows, int) and vocab > rows:
        raise UserError(f"{key}: the tokenizer of model_path has {vocab} tokens but {getattr(cfg, key)} embeds only "
                        f"vocab_size={rows} (config.json): use the tokenizer the model was trained with")


def _load(key: str, path: str, loader, what: str = "model", **kwargs):
    """A from_pretrained call whose failure names the key and the directory, in one line."""
    try:
        return loader(path, **kwargs)
    except UserError:   # already names the key and the directory
        raise
    except Exception as e:   # transformers raises OSError, ValueError, KeyError, ... for a bad directory
        raise UserError(f"{key}: cannot load a {what} from {path}: {first_line(e)}") from None


def max_over_ranks(accelerator):
    """count -> the largest count of any rank; a collective, so every rank calls it together."""
    def agree(count: int) -> int:
        if accelerator.num_processes == 1:
            return count
        return int(accelerator.gather(torch.tensor([count], device=accelerator.device)).max())
    return agree


def make_optimizer(model, lr: float, cfg: Config):
    """AdamW and its schedule, which steps once per training step."""
    # fused: one kernel over all tensors (on CPU about 5x faster than the per-tensor loop, same update)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=cfg.weight_decay,
                              fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: lr_factor(
        step, cfg.lr_warmup_steps or int(cfg.lr_warmup_steps_ratio * cfg.total_training_steps),
        cfg.total_training_steps, cfg.lr_scheduler_type, cfg.min_lr_ratio))
    return optim, sched


class PromptStream:
    """Each epoch a fresh seeded permutation of the training prompts, consumed in batches."""

    def __init__(self, n: int, batch_size: int, seed: int, names=("train_files", "train_batch_size")):
        if n < batch_size:
            raise UserError(f"{names[0]} hold {n} rows, fewer than {names[1]}={batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.pos = 0, 0

    def next(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        idx = order[self.pos:self.pos + self.batch_size].tolist()
        self.pos += self.batch_size
        return idx


class SFTStream:
    """The SFT mix's rows, drawn in seeded permutations like the prompts: every rank draws the same
    rows and takes its own share, so each rank runs exactly one SFT pass per mini-batch."""

    def __init__(self, pairs, batch_size: int, seed: int, rank: int, world: int, pad_id: int):
        self.prompts, self.responses = pairs
        self.rank, self.world, self.pad_id = rank, world, pad_id
        self.rows = PromptStream(len(self.prompts), batch_size, seed, names=("sft_files", "sft_batch_size"))

    def next(self) -> dict:
        idx = self.rows.next()[self.rank::self.world]
        return pack_batch([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.pad_id)


def sft_batch_size(cfg: Config, world: int) -> int:
    """sft_batch_size, or 5% of an actor mini-batch's sequences rounded up to one per process."""
    if cfg.sft_batch_size:
        return cfg.sft_batch_size
    share = math.ceil(0.05 * schedule(cfg, "actor").mini_batch * cfg.rollout_n / world)
    return max(1, share) * world


# ----------------------------------------------------------------------------------------------
# The update: ppo_epochs x mini-batches x micro-batches, one optimizer step per mini-batch.
# ----------------------------------------------------------------------------------------------
def mini_batch_norms(accelerator, mask, cfg: Config) -> dict:
    """Denominators for agg_loss over one whole mini-batch (all micro-batches, all ranks), so the
    micro-batch losses sum to the mini-batch loss. Gradients are averaged over ranks, hence the
    division by the world size (verl's dp_size factor)."""
    counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().to(mask.dtype)])
    counts = accelerator.reduce(counts, reduction="sum") / accelerator.num_processes
    return {"num_tokens": counts[0], "num_seqs": counts[1], "seq_len": cfg.max_response_length}


def backward(model, loss, ds: bool):
    # DeepSpeed would divide by its accumulation steps; our micro-batch losses already sum to the
    # mini-batch loss, so it must not
    model.backward(loss, scale_wrt_gas=False) if ds else loss.backward()


def optimizer_step(model, optim, max_norm: float, ds: bool) -> tuple[float, bool]:
    """Clip and step; a non-finite gradient norm skips the step (grads dropped) -> (norm, skipped)."""
    if ds:
        # the engine reduces the accumulated gradients, clips them to its gradient_clipping
        # (= max_norm), steps and zeroes them; ZeRO skips a step whose gradients overflow
        skipped_before = model.skipped_steps
        model.step()
        norm = model.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        return norm, model.skipped_steps > skipped_before or not math.isfinite(norm)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if not math.isfinite(norm):
        optim.zero_grad(set_to_none=True)
        return norm, True
    optim.step()
    optim.zero_grad(set_to_none=True)
    return norm, False


def sft_loss(accelerator, actor, sft: SFTStream, autocast) -> torch.Tensor:
    """Next-token NLL of one SFT micro-batch, normalised by the response tokens of all ranks (the
    gradient average over ranks then gives the mean over every rank's tokens)."""
    batch = to_device(sft.next(), accelerator.device)
    mask = batch["response_mask"]                                                  # [s, R]
    tokens = accelerator.reduce(mask.sum(), reduction="sum") / accelerator.num_processes
    with autocast():
        logprob, _ = response_logprobs(actor, batch, 1.0)                         # [s, R]
    return -(logprob * mask).sum() / tokens


def update_actor(accelerator, actor, optim, batch: dict, cfg: Config, autocast, ds: bool, sft=None,
                 temperature: float = 1.0, entropy_coeff: float = 0.0) -> dict:
    """guard/entropy (with entropy_floor): the entropy at the configured temperature, which a
    reacted sampling temperature does not move; measured over the first epoch, with one more
    no-grad pass per micro-batch only while the sampling temperature differs from it."""
    stats = Stats()
    sched = schedule(cfg, "actor")
    mini = sched.mini_batch * cfg.rollout_n // accelerator.num_processes
    agree = max_over_ranks(accelerator)
    low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    for epoch in range(sched.epochs):
        for mb in mini_batches(batch, mini):
            norms = mini_batch_norms(accelerator, mb["response_mask"], cfg)
            loss_total = {"actor/pg_loss": 0.0, "actor/kl_loss": 0.0}
            for _, micro in micro_batches(mb, sched.micro_batch, sched.max_tokens, agree):
                m = micro["response_mask"]
                if cfg.entropy_floor and epoch == 0 and temperature != cfg.temperature:
                    with autocast(), torch.no_grad():   # every rank reacts alike: the same passes everywhere
                        _, at_config = response_logprobs(actor, micro, cfg.temperature, with_entropy=True)
                    stats.add({"guard/entropy": masked_mean(at_config, m).item()})
                with autocast():
                    logprob, entropy = response_logprobs(actor, micro, temperature, with_entropy=True,
                                                         entropy_grad=entropy_coeff != 0)
                if cfg.entropy_floor and epoch == 0 and temperature == cfg.temperature:
                    stats.add({"guard/entropy": masked_mean(entropy.detach(), m).item()})
                pg, pg_stats = policy_loss(micro["old_logprob"], logprob, micro["advantages"], m, low, high,
                                           cfg.clip_ratio_c, cfg.loss_agg_mode, micro.get("is_weights"), **norms)
                loss = pg
                if entropy_coeff:
                    loss = loss - entropy_coeff * agg_loss(entropy, m, cfg.loss_agg_mode, **norms)
                if cfg.use_kl_loss:
                    kl_loss = agg_loss(kl.kl_penalty(logprob, micro["ref_logprob"], cfg.kl_loss_type), m,
                                       cfg.loss_agg_mode, **norms)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                    loss_total["actor/kl_loss"] += kl_loss.item()
                backward(actor, loss, ds)
                loss_total["actor/pg_loss"] += pg.item()
                stats.add({f"actor/{k}": v.item() for k, v in pg_stats.items()})
                stats.add({"actor/entropy": masked_mean(entropy.detach(), m).item()})
            if sft is not None:   # PPO-ptx: one pass of supervised data in every mini-batch, on every rank
                nll = sft_loss(accelerator, actor, sft, autocast)
                backward(actor, cfg.sft_coef * nll, ds)
                stats.add({"actor/sft_loss": nll.item()})
            grad_norm, skipped = optimizer_step(actor, optim, cfg.max_grad_norm, ds)
            stats.add(loss_total if cfg.use_kl_loss else {"actor/pg_loss": loss_total["actor/pg_loss"]})
            stats.add({"actor/grad_norm": grad_norm if not skipped else float("nan")})
            stats.count("actor/skipped_steps", skipped)
    return stats.means()


def update_critic(accelerator, critic, optim, batch: dict, cfg: Config, autocast, ds: bool) -> dict:
    stats = Stats()
    sched = schedule(cfg, "critic")
    mini = sched.mini_batch * cfg.rollout_n // accelerator.num_processes
    agree = max_over_ranks(accelerator)
    for _ in range(sched.epochs):
        for mb in mini_batches(batch, mini):
            norms = mini_batch_norms(accelerator, mb["response_mask"], cfg)
            vf_total = 0.0
            for _, micro in micro_batches(mb, sched.micro_batch, sched.max_tokens, agree):
                with autocast():
                    vpreds = critic_values(critic, micro)
                vf, clipfrac = value_loss(vpreds, micro["returns"], micro["values"], micro["response_mask"],
                                          cfg.cliprange_value, cfg.loss_agg_mode, **norms)
                backward(critic, vf, ds)
                vf_total += vf.item()
                stats.add({"critic/vf_clipfrac": clipfrac.item(),
                           "critic/vpred_mean": masked_mean(vpreds.detach(), micro["response_mask"]).item()})
            grad_norm, skipped = optimizer_step(critic, optim, cfg.critic_max_grad_norm, ds)
            stats.add({"critic/vf_loss": vf_total, "critic/grad_norm": grad_norm if not skipped else float("nan")})
    return stats.means()


class Stats:
    """Collects a step's metric values; each metric is the mean over everything recorded."""

    def __init__(self):
        self.values: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict):
        # a NaN (e.g. the norm of a skipped step) is kept so the key is: under several processes every
        # rank must reduce the same keys, whatever its data
        for k, v in metrics.items():
            self.values.setdefault(k, []).append(float(v))

    def count(self, key: str, hit: bool):
        self.counts[key] = self.counts.get(key, 0) + int(hit)

    def means(self) -> dict:
        """Each metric's mean over its non-NaN values; NaN if it had none."""
        out = {}
        for k, v in self.values.items():
            kept = [x for x in v if not math.isnan(x)]
            out[k] = sum(kept) / len(kept) if kept else float("nan")
        out.update(self.counts)
        return out


@contextmanager
def timed(times: dict, name: str):
    start = time.perf_counter()
    yield
    times[f"time/{name}_s"] = times.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Rewards, validation, the main loop.
# ----------------------------------------------------------------------------------------------
class Scorer:
    """The reward: a verifier/reward function on decoded text, or a reward model on token ids."""

    def __init__(self, cfg: Config, tokenizer, reward_model):
        self.cfg, self.tokenizer, self.reward_model = cfg, tokenizer, reward_model
        self.fn = None if cfg.reward_model_path else load_reward_fn(cfg.reward_fn)
        self.is_verifier = bool(getattr(self.fn, "is_verifier", False))
        self.columns = reward_fn_columns(self.fn) if self.fn else []

    def __call__(self, prompts: PromptSet, responses: list[list[int]], batch: dict, micro: int) -> torch.Tensor:
        if self.reward_model is not None:
            scores = forward_in_micro_batches(lambda mb: reward_model_scores(self.reward_model, mb), batch, micro)
        else:
            texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            scores = score_with_fn(self.fn, self.cfg.reward_fn, prompts.texts, texts, prompts.columns,
                                   self.cfg.skip_nonfinite_rewards)
        return scores                                                             # [B]


def shape_scores(cfg: Config, scores, lengths, truncated, valid=None):
    """Training rewards from raw scores: DAPO overlong shaping, the truncation penalty, then
    clipping; a dropped sample (valid False: a non-finite score) gets 0, no penalty. Validation
    and reward/* metrics report the raw scores."""
    if cfg.overlong_buffer_len > 0:
        scores = scores + overlong_penalty(lengths, cfg.max_response_length, cfg.overlong_buffer_len,
                                           cfg.overlong_penalty_factor)
    if cfg.truncation_penalty:
        scores = scores - cfg.truncation_penalty * truncated.to(scores.dtype)
    if cfg.reward_clip > 0:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    if valid is not None:
        scores = torch.where(valid, scores, torch.zeros_like(scores))
    return scores                                                                 # [B]


def place_scores(scores, response_mask):
    """A sequence's score sits on its last real response token -> [B, R]."""
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)                        # [B]
    token_scores = torch.zeros(response_mask.shape, dtype=scores.dtype, device=response_mask.device)
    token_scores[torch.arange(len(scores)), last] = scores
    return token_scores


def compute_advantages(cfg: Config, token_rewards, values, mask, group_ids, valid):
    if cfg.adv_estimator == "gae":
        return compute_gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.adv_estimator == "grpo":
        return compute_grpo_advantages(token_rewards, mask, group_ids, cfg.norm_adv_by_std_in_grpo, valid=valid)
    if cfg.adv_estimator == "rloo":
        return compute_rloo_advantages(token_rewards, mask, group_ids, valid)
    if cfg.adv_estimator == "reinforce_plus_plus":
        return compute_reinforce_pp_advantages(token_rewards, mask, cfg.gamma)
    return compute_reinforce_pp_baseline_advantages(token_rewards, mask, group_ids, valid)


def validation_share(n: int, world: int, rank: int) -> tuple[list[int], int]:
    """This rank's validation prompts -> (indices, how many of them count). Every rank gets
    ceil(n / world) prompts, so all run the same number of passes (under ZeRO-3 a rank with fewer
    would hang the others); the ranks short of prompts repeat prompt 0, which does not count."""
    mine = list(range(rank, n, world))
    share = -(-n // world)
    return mine + [0] * (share - len(mine)), len(mine)


def run_validation(cfg, accelerator, engine, scorer, tokenizer, val: PromptSet) -> tuple[dict, dict]:
    """Greedy (by default) generation on this rank's share of the validation prompts; scores are
    summed over ranks, so the figures cover the whole validation set."""
    idx, real = validation_share(len(val.ids), accelerator.num_processes, accelerator.process_index)
    mine = val.take(idx)
    params = SamplingParams(n=1, temperature=cfg.val_temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_tokens=cfg.max_response_length)
    responses = engine.generate(mine.ids, params).responses
    batch = to_device(pack_batch(mine.ids, responses, tokenizer.pad_token_id), accelerator.device)
    scores = scorer(mine, responses, batch, cfg.ppo_micro_batch_size_per_device).to(accelerator.device)[:real]
    texts, responses = mine.texts[:real], responses[:real]
    sums = torch.stack([scores.sum(), (scores >= 1.0).float().sum(), torch.tensor(float(len(scores)), device=scores.device)])
    total, correct, count = accelerator.reduce(sums.double(), reduction="sum").tolist()
    metrics = {"val/score_mean": total / count}
    if scorer.is_verifier:
        metrics["val/accuracy"] = correct / count
    n = min(cfg.log_samples, len(texts))
    samples = {"prompt": texts[:n], "response": tokenizer.batch_decode(responses[:n], skip_special_tokens=True),
               "score": scores[:n].tolist()}
    return metrics, samples


def make_engine(cfg: Config, actor, tokenizer, contexts, world: int, rank: int, kind: str = ""):
    """The rollout engine of `kind` (default cfg.rollout_engine). vLLM runs in this process (one
    engine per rank) and gets the actor's weights after every update; the hf engine generates on
    the actor itself."""
    from rollout.hf import HFEngine
    if (kind or cfg.rollout_engine) == "vllm":
        from rollout.vllm import VLLMEngine
        try:
            return VLLMEngine(cfg.model_path, dtype=cfg.dtype, seed=cfg.seed + rank,
                              max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                              kv_cache_gb=cfg.rollout_kv_cache_gb,
                              gpu_memory_utilization=cfg.rollout_gpu_memory_utilization,
                              enable_sleep_mode=cfg.rollout_sleep, distributed=world > 1,
                              enforce_eager=cfg.rollout_enforce_eager, sleep_level=cfg.rollout_sleep_level,
                              eos_token_id=tokenizer.eos_token_id)
        except RuntimeError as e:
            if not cfg.rollout_fallback_hf:
                raise UserError(f"{e}\n(or set rollout_fallback_hf=true to generate with the hf engine)") from None
            print(f"warning: vLLM did not start, generating with the hf engine (rollout_fallback_hf): {e}",
                  file=sys.stderr)
    return HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.rollout_micro_batch_size, contexts)


def weight_units(module) -> list[tuple[list, typing.Callable]]:
    """The actor's weights as the rollout engine names them, in units of (parameters, make) where
    make() -> [(Hugging Face name, tensor)] once those parameters are whole. A LoRA layer is one
    unit: its base weight with the adapter merged in (W + B A * alpha / r), named as in a model
    without adapters, which is what vLLM loads."""
    if not hasattr(module, "peft_config"):
        return [([p], lambda name=name, p=p: [(name, p.data)]) for name, p in module.named_parameters()]
    base, units = module.get_base_model(), []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer", "")
        if name.endswith(".base_layer.weight"):
            layer = base.get_submodule(name[:-len(".base_layer.weight")])
            adapter = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
            units.append(([p, *adapter], lambda plain=plain, p=p, layer=layer: [
                (plain, p.data + layer.get_delta_weight("default").to(p.dtype))]))
        else:
            units.append(([p], lambda plain=plain, p=p: [(plain, p.data)]))
    return units


def actor_weights(actor, ds: bool, bucket_mb: float):
    """(Hugging Face name, tensor) pairs of the actor for the rollout engine (LoRA merged in).
    Under ZeRO-3 the shards are gathered a bucket of about bucket_mb at a time and released after,
    so no rank ever holds the whole model; the engine consumes the generator as it goes. Every
    rank must consume it: each bucket's gather is a collective."""
    units = weight_units(actor.module if ds else actor)
    if not ds or actor.zero_optimization_stage() != 3:
        for _, make in units:
            yield from make()
        return
    import deepspeed
    budget, bucket, size = bucket_mb * 2**20, [], 0
    for i, (params, make) in enumerate(units):
        bucket.append((params, make))
        size += sum(p.ds_numel * p.element_size() for p in params)
        if size >= budget or i == len(units) - 1:
            with deepspeed.zero.GatheredParameters([p for ps, _ in bucket for p in ps]):
                for _, make_one in bucket:
                    yield from make_one()
            bucket, size = [], 0


# ----------------------------------------------------------------------------------------------
# Distribution: Accelerate, with one DeepSpeed plugin per model under DeepSpeed (distributed.py).
# ----------------------------------------------------------------------------------------------
def make_accelerator(cfg: Config):
    """-> (accelerator, ds): each model's role (trained or frozen, micro-batch, clipping, offload)
    decides its DeepSpeed engine config under `accelerate launch` with DeepSpeed."""
    roles = {"actor": Role(True, schedule(cfg, "actor").micro_batch, cfg.max_grad_norm)}
    if cfg.adv_estimator == "gae":
        roles["critic"] = Role(True, schedule(cfg, "critic").micro_batch, cfg.critic_max_grad_norm)
    if cfg.use_kl_in_reward or cfg.use_kl_loss:
        roles["ref"] = Role(False, schedule(cfg, "actor").micro_batch, offload=cfg.ref_offload)
    if cfg.reward_model_path:
        roles["reward"] = Role(False, schedule(cfg, "actor").micro_batch, offload=cfg.reward_offload)
    owned = {"train_micro_batch_size_per_gpu": ("ppo_micro_batch_size_per_device", cfg.ppo_micro_batch_size_per_device),
             "gradient_clipping": ("max_grad_norm", cfg.max_grad_norm)}
    return distributed.make_accelerator(cfg.dtype == "bf16", roles, owned)


def check_world_size(cfg: Config, world: int) -> None:
    for key in ("train_batch_size", "ppo_mini_batch_size", "critic_ppo_mini_batch_size", "sft_batch_size"):
        if getattr(cfg, key) is not None and getattr(cfg, key) % world:
            raise UserError(f"{key}={getattr(cfg, key)} is not divisible by the {world} processes: change {key} "
                            f"or num_processes")


def prepare_models(accelerator, ds: bool, cfg: Config, actor, critic, ref, reward_model):
    """Trained models with their optimizers (and DeepSpeed engines under DeepSpeed); frozen ones as
    inference-only engines, or simply moved to the device."""
    def select(name):
        if ds:
            accelerator.state.select_deepspeed_plugin(name)

    actor_optim, actor_sched = make_optimizer(actor, cfg.actor_lr, cfg)
    select("actor")
    actor, actor_optim = accelerator.prepare(actor, actor_optim)
    critic_optim = critic_sched = None
    if critic is not None:
        critic_optim, critic_sched = make_optimizer(critic, cfg.critic_lr, cfg)
        select("critic")
        critic, critic_optim = accelerator.prepare(critic, critic_optim)
    frozen = []
    for name, model in (("ref", ref), ("reward", reward_model)):
        if model is not None and ds:
            select(name)
            model = accelerator.prepare(model)
            model.eval()
        elif model is not None:
            model = model.to(accelerator.device)
        frozen.append(model)
    select("actor")
    local, total = param_share(actor)
    if accelerator.num_processes > 1:
        print(f"rank {accelerator.process_index}/{accelerator.num_processes}: actor holds {local} of {total} "
              f"parameters ({100 * local / total:.1f}%)", flush=True)
    return actor, actor_optim, actor_sched, critic, critic_optim, critic_sched, frozen[0], frozen[1]


def gather_rows(accelerator, t):
    """Every rank's [b, R_rank] rows -> the whole batch [B, R_max] on every rank, in rank order."""
    return accelerator.gather(accelerator.pad_across_processes(t, dim=1))


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Mean of each metric over the ranks where it is not NaN (NaN where it is on all), all in one
    collective, after a 2-number one that checks every rank has the same keys: ranks reducing
    different key lists would hang, or abort, or pair values with the wrong names."""
    if accelerator.num_processes == 1:
        return metrics
    keys = sorted(metrics)
    signature = torch.tensor([len(keys), zlib.crc32("\n".join(keys).encode())], dtype=torch.float64,
                             device=accelerator.device)
    if (accelerator.gather(signature).view(-1, 2) != signature).any():
        from accelerate.utils import gather_object
        every = gather_object([keys])
        odd = sorted(set().union(*every) - set.intersection(*map(set, every)))
        raise RuntimeError(f"ranks reduce different metric keys (a metric must not depend on a rank's data): {odd}")
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=accelerator.device)  # [n]
    seen = ~values.isnan()                                                                                   # [n]
    sums = accelerator.reduce(torch.cat([torch.where(seen, values, 0.0), seen.double()]), reduction="sum")   # [2n]
    total, count = sums[:len(keys)], sums[len(keys):]
    return dict(zip(keys, torch.where(count > 0, total / count.clamp(min=1), float("nan")).tolist()))


def rewards_and_advantages(cfg, accelerator, kl_ctrl, batch, token_scores, group_ids, valid) -> dict:
    """Phase 4 on the whole batch (gathered from all ranks): KL in the reward, the controller
    update, advantages with whitening over every valid token of the step; returns this rank's rows.
    N ranks x B/N prompts thus give the statistics of 1 rank x B prompts."""
    rows, R = token_scores.shape
    start = accelerator.process_index * rows
    full = {k: gather_rows(accelerator, v) for k, v in
            {"scores": token_scores, "mask": batch["response_mask"], "old": batch["old_logprob"],
             "ref": batch.get("ref_logprob", batch["old_logprob"]),
             "values": batch.get("values", torch.zeros_like(token_scores))}.items()}
    metrics = {}
    beta = kl_ctrl.value   # read before the update, as verl does
    token_rewards = full["scores"]
    if "ref_logprob" in batch:
        shaped, current_kl = kl_in_reward(full["scores"], full["old"], full["ref"], full["mask"],
                                          beta if cfg.use_kl_in_reward else 0.0, cfg.kl_penalty)
        if cfg.use_kl_in_reward:
            token_rewards = shaped
            kl_ctrl.update(current_kl.item(), n_steps=full["scores"].shape[0])
        metrics = {"kl/mean": current_kl.item(), "kl/coef": beta if cfg.use_kl_in_reward else 0.0}
    all_valid = accelerator.gather(valid.float()) > 0                                             # [B]
    adv, returns = compute_advantages(cfg, token_rewards, full["values"], full["mask"], group_ids, all_valid)
    if cfg.adv_estimator == "gae":
        metrics["critic/explained_var"] = explained_variance(returns, full["values"], full["mask"]).item()
    batch["advantages"] = adv[start:start + rows, :R]
    batch["returns"] = returns[start:start + rows, :R]
    return metrics


@dataclass
class Run:
    """Everything one training run holds, built by setup()."""
    cfg: Config
    accelerator: typing.Any
    ds: bool                        # DeepSpeed engines (else plain modules)
    tokenizer: typing.Any
    actor: typing.Any
    critic: typing.Any              # None for critic-free estimators
    ref: typing.Any                 # None without KL
    trained: dict                   # name -> (model, optimizer, lr scheduler)
    engine: typing.Any              # the rollout engine
    scorer: Scorer
    kl_ctrl: typing.Any
    train: PromptSet
    val: PromptSet | None
    stream: PromptStream
    sft: SFTStream | None           # the SFT mix's rows (sft_files)
    guards: Guards
    tracker: Tracker
    autocast: typing.Any
    first_step: int = 1
    resumed: dict | None = None
    engine_state: dict | None = None   # the rollout engine's state from a checkpoint
    hf: typing.Any = None              # the actor as a sampler, for rollout_on_drift=regenerate
    parked: typing.Any = None          # a vLLM engine that started while another rank's did not: asleep, unused
    shapes: dict = field(default_factory=dict)   # role -> flops.Shape, for perf/mfu
    peak_flops: float = 0.0                      # the device's peak FLOP/s; 0 = unknown, no perf/mfu


def hf_engine(run: Run):
    """The hf engine on the actor (built on first use), to sample a step on-policy."""
    if run.hf is None:
        run.hf = make_engine(run.cfg, run.accelerator.unwrap_model(run.actor), run.tokenizer,
                             [gathered_params(run.actor, run.ds), run.autocast], run.accelerator.num_processes,
                             run.accelerator.process_index, kind="hf")
    return run.hf


def setup(cfg: Config) -> Run:
    """Accelerator, models (DeepSpeed engines under DeepSpeed), data, rollout engine, tracking; a
    checkpoint to resume from is found and checked before any model loads, and loaded after."""
    lean_imports.skip_unused()   # before Accelerate imports DeepSpeed (load_models repeats it for direct callers)
    host_memory.return_large_blocks(cfg.malloc_mmap_threshold_mb)   # before the models' tensors exist
    import yaml
    from accelerate.utils import set_seed

    accelerator, ds = make_accelerator(cfg)
    world, rank = accelerator.num_processes, accelerator.process_index
    check_world_size(cfg, world)
    if accelerator.is_main_process:
        for note in config_warnings(cfg):
            print(f"warning: {note}", file=sys.stderr, flush=True)
    ckpt = find_checkpoint(cfg.resume, cfg.output_dir)
    resumed = read_state(ckpt) if ckpt else None
    if resumed:
        for note in check_resumable(dataclasses.asdict(cfg), resumed, ckpt):
            if accelerator.is_main_process:
                print(f"resume: {note}", flush=True)
    set_seed(cfg.seed)          # the same initialisation (e.g. the value head) on every rank
    out_dir = Path(cfg.output_dir)
    if accelerator.is_main_process:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        except OSError as e:
            raise UserError(f"output_dir {out_dir} cannot be written: {e.strerror or e}") from None
    autocast = accelerator.autocast if cfg.dtype == "bf16" and not ds else nullcontext

    tokenizer, actor, critic, ref, reward_model = load_models(cfg)
    scorer = Scorer(cfg, tokenizer, None)
    read = lambda files: load_prompts(files, cfg.prompt_key, tokenizer, cfg.max_prompt_length,   # noqa: E731
                                      cfg.prompt_truncation, scorer.columns, cfg.reward_fn)
    train, val = read(cfg.train_files), (read(cfg.val_files) if cfg.val_files else None)
    sft = SFTStream(load_sft(cfg, tokenizer), sft_batch_size(cfg, world), cfg.seed, rank, world,
                    tokenizer.pad_token_id) if cfg.sft_files else None
    (actor, actor_optim, actor_sched, critic, critic_optim, critic_sched, ref,
     scorer.reward_model) = prepare_models(accelerator, ds, cfg, actor, critic, ref, reward_model)
    set_seed(cfg.seed + rank)   # each rank samples differently; data order uses cfg.seed alone
    trained = {"actor": (actor, actor_optim, actor_sched)}
    if critic is not None:
        trained["critic"] = (critic, critic_optim, critic_sched)
    run = Run(cfg, accelerator, ds, tokenizer, actor, critic, ref, trained, None, scorer,
              kl.make_kl_controller(cfg.kl_ctrl_type, cfg.kl_coef, cfg.target_kl, cfg.kl_horizon),
              train, val, PromptStream(len(train.ids), cfg.train_batch_size, cfg.seed), sft, Guards(cfg), None,
              autocast)
    if resumed:
        restore(run, ckpt, resumed)
        rescale_lr(*run.trained["actor"][1:], resumed_lr_scale(cfg.actor_lr, resumed))   # e.g. a guard's advice
        if accelerator.is_main_process:
            print(f"resuming from {ckpt} (step {resumed['step']})", flush=True)
    run.resumed = resumed
    run.shapes = {role: flops.shape_of(_unwrap(m)) for role, m in
                  (("actor", actor), ("ref", ref), ("critic", critic), ("reward", scorer.reward_model)) if m is not None}
    # the lowest over ranks (a collective every rank runs here), so that with GPUs of different
    # kinds every rank logs perf/mfu or none does: the step's metrics are reduced as one tensor
    peak = torch.tensor([flops.peak(accelerator.device, cfg.dtype == "bf16", cfg.peak_tflops)], device=accelerator.device)
    run.peak_flops = float(accelerator.gather(peak).min())
    run.engine = make_engine(cfg, accelerator.unwrap_model(actor), tokenizer, [gathered_params(actor, ds), autocast],
                             world, rank)
    if cfg.rollout_engine == "vllm" and world > 1:
        # rollout_fallback_hf: all ranks fall back together, or the vLLM ranks would wait in the
        # weight sync's ZeRO-3 gathers for a rank that never joins them
        started = accelerator.gather(torch.tensor([float(run.engine.name == "vllm")], device=accelerator.device))
        if not started.all() and run.engine.name == "vllm":
            print(f"warning: rank {rank}: vLLM started here but not on every rank: all ranks generate with the hf "
                  "engine (rollout_fallback_hf)", file=sys.stderr, flush=True)
            run.engine.sleep()   # kept, not shut down: vLLM's teardown destroys the process group
            run.parked, run.engine = run.engine, make_engine(cfg, accelerator.unwrap_model(actor), tokenizer,
                                                             [gathered_params(actor, ds), autocast], world, rank,
                                                             kind="hf")
    run.engine.load_weights(actor_weights(actor, ds, cfg.rollout_sync_bucket_mb))   # e.g. a resumed actor
    if resumed:
        run.engine.load_state_dict(run.engine_state)
    tags = run_tags(world, distributed.zero_stage(accelerator), run.engine.name, HERE)
    run.tracker = Tracker(out_dir, accelerator.is_main_process, uri=cfg.mlflow_tracking_uri,
                          experiment=cfg.mlflow_experiment, run_name=cfg.run_name, params=dataclasses.asdict(cfg),
                          tags=tags, system_metrics=cfg.mlflow_system_metrics, resumed=resumed,
                          log_model=cfg.mlflow_log_model,
                          datasets={"training": _split_files(cfg.train_files), "validation": _split_files(cfg.val_files),
                                    "sft": _split_files(cfg.sft_files)})
    return run


def restore(run: Run, path: Path, state: dict) -> None:
    """A checkpoint's models, optimizers, schedules, RNGs, KL controller and data position."""
    mine = load_checkpoint(run.accelerator, run.ds, path, state, run.trained)
    run.engine_state = mine.get("engine", {})   # the sampler's seed counter: a resumed run samples the same
    if run.engine is not None:
        run.engine.load_state_dict(run.engine_state)
    run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    run.stream.epoch, run.stream.pos = state["data"]["epoch"], state["data"]["pos"]
    run.guards.entropy_reaction = state.get("entropy_reaction", False)
    run.guards.rollbacks = max(run.guards.rollbacks, state.get("rollbacks", 0))
    if run.sft is not None and state.get("sft_data"):
        run.sft.rows.epoch, run.sft.rows.pos = state["sft_data"]["epoch"], state["sft_data"]["pos"]
    run.first_step = state["step"] + 1


@dataclass
class Rollouts:
    """One step's samples on this rank, scored, with the no-grad forward passes done."""
    batch: dict                     # pack_batch's tensors + old_logprob, ref_logprob, values, is_weights
    responses: list[list[int]]
    scores: torch.Tensor            # [b] the reward's score per sequence (0 where non-finite)
    nonfinite: torch.Tensor         # [b] bool: dropped from the update (skip_nonfinite_rewards)
    truncated: torch.Tensor         # [b] bool: cut at max_response_length without EOS
    token_scores: torch.Tensor      # [b, R] the shaped score on each sequence's last token
    sampler: torch.Tensor           # [b, R] the sampler's log-probs, of the distribution it drew from
    actor_sampling: torch.Tensor    # [b, R] the actor's under that distribution (old_logprob unless top_k/top_p cut)
    is_stats: dict


def collect(run: Run, idx: list[int], engine, temperature: float, times: dict) -> Rollouts:
    """Phases 1-3 on this rank's prompts idx: generate, score, forward passes."""
    cfg, accelerator, tokenizer, device = run.cfg, run.accelerator, run.tokenizer, run.accelerator.device
    micro = cfg.log_prob_micro_batch_size_per_device or cfg.ppo_micro_batch_size_per_device   # no-grad passes
    prompts = run.train.take(idx, cfg.rollout_n)                                   # one row per response

    # 1 generate: rollout_n responses per prompt, prompt-major order
    with timed(times, "gen"):
        sampling = SamplingParams(n=cfg.rollout_n, temperature=temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  max_tokens=cfg.max_response_length, ignore_eos=cfg.rollout_ignore_eos)
        rollout = engine.generate(run.train.take(idx).ids, sampling)
        engine.sleep()   # vLLM on GPU: weights and KV cache leave the GPU while the models train
        batch = to_device(pack_batch(prompts.ids, rollout.responses, tokenizer.pad_token_id), device)
        mask = batch["response_mask"]                                                          # [b, R]

    # 2 score: one score per sequence, shaped, on its last response token
    with timed(times, "score"):
        scores = run.scorer(prompts, rollout.responses, batch, micro).to(device)               # [b]
        nonfinite = ~torch.isfinite(scores)                     # only with skip_nonfinite_rewards
        if nonfinite.any():   # those samples take no part in the update
            scores, mask[nonfinite] = torch.where(nonfinite, 0.0, scores), 0.0
        truncated = is_truncated(rollout.responses, tokenizer.eos_token_id, cfg.max_response_length)
        token_scores = place_scores(shape_scores(cfg, scores, mask.sum(-1), truncated.to(device), ~nonfinite), mask)

    # 3 forward passes, no grad: old log-probs (actor), ref log-probs, values (critic)
    with timed(times, "forward"), run.autocast():
        logprobs_of = lambda model: lambda mb: response_logprobs(model, mb, temperature)[0]   # noqa: E731
        actor_sched, critic_sched = schedule(cfg, "actor"), schedule(cfg, "critic")
        passes = dict(size=micro, max_tokens=actor_sched.max_tokens, agree=max_over_ranks(accelerator))
        truncation = (cfg.top_k, cfg.top_p) if cfg.top_k > 0 or cfg.top_p < 1 else None
        if truncation is None:
            batch["old_logprob"] = forward_in_micro_batches(logprobs_of(run.actor), batch, **passes)  # [b, R]
            actor_sampling = batch["old_logprob"]
        else:   # the samplers report log-probs of the cut distribution: the actor's too, from the same pass
            def full_and_cut(mb):
                logprob, _, cut = response_logprobs(run.actor, mb, temperature, truncation=truncation)
                return torch.stack([logprob, cut], dim=-1)                                    # [b, r, 2]
            both = forward_in_micro_batches(full_and_cut, batch, **passes)                    # [b, R, 2]
            batch["old_logprob"], actor_sampling = both[..., 0].contiguous(), both[..., 1].contiguous()
        if run.ref is not None:
            batch["ref_logprob"] = forward_in_micro_batches(logprobs_of(run.ref), batch, **passes)
        elif cfg.lora_rank and (cfg.use_kl_in_reward or cfg.use_kl_loss):
            with accelerator.unwrap_model(run.actor).disable_adapter():   # the base model is the reference
                batch["ref_logprob"] = forward_in_micro_batches(logprobs_of(run.actor), batch, **passes)
        if run.critic is not None:
            batch["values"] = forward_in_micro_batches(lambda mb: critic_values(run.critic, mb), batch,
                                                       size=critic_sched.micro_batch, max_tokens=critic_sched.max_tokens,
                                                       agree=passes["agree"])
        # both engines report them (an engine that did not would count as the actor itself)
        sampler = actor_sampling if rollout.logprobs is None else sampler_logprobs(rollout.logprobs, mask)
        is_stats = {}
        if cfg.rollout_is != "off":   # sampler against actor under one distribution: see the README on top_p/top_k
            batch["is_weights"], is_stats = rollout_is_weights(actor_sampling, sampler, mask, cfg.rollout_is,
                                                               cfg.rollout_is_threshold)
    return Rollouts(batch, rollout.responses, scores, nonfinite, truncated, token_scores, sampler, actor_sampling,
                    is_stats)


def sampler_drift(accelerator, data: Rollouts) -> float:
    """rollout/logprob_diff: the mean |sampler - actor| log-prob over every rank's response tokens,
    both under the distribution the sampler drew from (with top_k/top_p: cut and renormalised), so
    it measures the weights and kernels, not the truncation."""
    mask = data.batch["response_mask"]
    sums = torch.stack([((data.sampler - data.actor_sampling).abs() * mask).sum(), mask.sum()]).double()
    total, count = accelerator.reduce(sums, reduction="sum").tolist()
    return total / max(count, 1.0)


def train_step(run: Run, step: int) -> dict:
    """One PPO iteration on this rank's share of the prompt batch -> the step's metrics, reduced
    over ranks, with the time of each phase."""
    cfg, accelerator, engine = run.cfg, run.accelerator, run.engine
    device, world = accelerator.device, accelerator.num_processes
    times: dict = {}
    step_start = time.perf_counter()
    temperature = run.guards.temperature   # entropy_floor may have changed it
    per_rank = cfg.train_batch_size // world
    idx = run.stream.next()[accelerator.process_index * per_rank:][:per_rank]     # this rank's prompts
    group_ids = torch.arange(cfg.train_batch_size, device=device).repeat_interleave(cfg.rollout_n)  # [B] all ranks

    # 1-3 generate, score, forward passes
    data = collect(run, idx, engine, temperature, times)
    # every engine reports its log-probs, so every rank runs this collective whatever engine it got
    drift = sampler_drift(accelerator, data)
    regenerated = False
    if cfg.rollout_max_logprob_diff > 0 and drift > cfg.rollout_max_logprob_diff:
        if cfg.rollout_on_drift == "stop":
            raise UserError(f"step {step}: rollout/logprob_diff={drift:.4g} > rollout_max_logprob_diff="
                            f"{cfg.rollout_max_logprob_diff}: the sampler's weights no longer match the actor's (set "
                            f"rollout_on_drift=regenerate or raise rollout_max_logprob_diff, and resume with the same "
                            f"command and that change)")
        # regenerate: sample this step on-policy with the actor while vLLM sleeps (on a GPU its
        # memory stays free for the hf engine and the update); phase 6 re-sends every weight anyway
        if accelerator.is_main_process:
            print(f"warning: step {step}: rollout/logprob_diff={drift:.4g} > rollout_max_logprob_diff="
                  f"{cfg.rollout_max_logprob_diff}: step regenerated with the hf engine, weights re-sent after "
                  "the update", file=sys.stderr, flush=True)
        data, regenerated = collect(run, idx, hf_engine(run), temperature, times), True
    batch, scores, truncated, mask = data.batch, data.scores, data.truncated, data.batch["response_mask"]
    nonfinite, valid, token_scores, is_stats = data.nonfinite, ~data.nonfinite, data.token_scores, data.is_stats

    # 4 rewards and advantages over the whole batch (timed with the forward passes: it is tiny)
    with timed(times, "forward"):
        metrics = rewards_and_advantages(cfg, accelerator, run.kl_ctrl, batch, token_scores, group_ids, valid)

    # 5 update: critic, then actor (after critic_warmup steps)
    updates: dict = {}   # each model's share of the update's time, for perf/mfu
    with timed(times, "update"):
        if run.critic is not None:
            critic, critic_optim, critic_sched = run.trained["critic"]
            with recompute_activations(critic, critic_checkpointing(cfg)), timed(updates, "critic"):
                metrics.update(update_critic(accelerator, critic, critic_optim, batch, cfg, run.autocast, run.ds))
            critic_sched.step()
        if step >= cfg.critic_warmup:   # verl: update the actor once global_steps >= critic_warmup
            actor, actor_optim, actor_sched = run.trained["actor"]
            with recompute_activations(actor, cfg.gradient_checkpointing), timed(updates, "actor"):
                metrics.update(update_actor(accelerator, actor, actor_optim, batch, cfg, run.autocast, run.ds, run.sft,
                                            temperature, run.guards.entropy_coeff))
            metrics["actor/lr"] = actor_sched.get_last_lr()[0]
            actor_sched.step()

    # 6 sync: the updated actor into the rollout engine (a no-op for hf: it is the actor)
    with timed(times, "sync"):
        engine.wake_up(["weights"])
        engine.load_weights(actor_weights(run.actor, run.ds, cfg.rollout_sync_bucket_mb))
        engine.wake_up(["kv_cache"])

    # 7 log: each metric reduced over ranks once
    with timed(times, "log"):
        metrics.update({
            "reward/score_mean": scores.mean().item(),
            "reward/score_std": scores.std().item() if len(scores) > 1 else 0.0,
            "rollout/response_len_mean": mask.sum(-1).mean().item(),
            "rollout/truncated_frac": truncated.float().mean().item(),
            "perf/tokens": batch["attention_mask"].sum().item() * world,   # the mean over ranks makes it a sum
        })
        if run.scorer.is_verifier:
            metrics["reward/accuracy"] = (scores >= 1.0).float().mean().item()
        if cfg.entropy_floor:
            metrics.update({"guard/entropy_reaction": float(run.guards.entropy_reaction),
                            "guard/temperature": temperature, "guard/entropy_coeff": run.guards.entropy_coeff})
        if cfg.skip_nonfinite_rewards:
            metrics["reward/nonfinite_frac"] = nonfinite.float().mean().item()
        metrics["rollout/logprob_diff"] = drift
        if cfg.rollout_on_drift == "regenerate":
            metrics["rollout/regenerated"] = float(regenerated)
        metrics.update({f"rollout_is/{k}": v.item() for k, v in is_stats.items()})
        if run.peak_flops:
            metrics.update(model_flops_utilisation(run, batch, updates, world))
        metrics = reduce_metrics(accelerator, {**metrics, **times})
    metrics.update(times)   # this rank's own clock, so the phases add up to its step
    metrics["time/step_s"] = time.perf_counter() - step_start
    metrics["perf/tokens_per_s"] = metrics.pop("perf/tokens") / metrics["time/step_s"]
    if run.peak_flops:
        metrics["perf/mfu"] = metrics.pop("perf/flops") / (metrics["time/step_s"] * run.peak_flops * world)
    return metrics


def model_flops_utilisation(run: Run, batch: dict, updates: dict, world: int) -> dict:
    """perf/mfu/actor and perf/mfu/critic: each update's model FLOPs (flops.py) over its time at the
    device's peak; perf/flops: the step's model FLOPs on all ranks (perf/mfu once the step's time is
    known). Generation counts as one forward pass of the actor; the SFT mix is not counted."""
    lens = batch["attention_mask"].sum(-1)                                        # [b]
    forward = {role: flops.forward(shape, lens) for role, shape in run.shapes.items()}
    trained = {role: 3 * forward[role] * schedule(run.cfg, role).epochs for role in ("actor", "critic")
               if f"time/{role}_s" in updates}
    done = 2 * forward["actor"] + sum(trained.values())                           # generation, old log-probs
    done += forward.get("ref", forward["actor"]) if "ref_logprob" in batch else 0.0   # a LoRA actor's base is the ref
    done += forward["critic"] if "values" in batch else 0.0
    done += forward.get("reward", 0.0)
    out = {f"perf/mfu/{role}": f / (updates[f"time/{role}_s"] * run.peak_flops) for role, f in trained.items()}
    return {**out, "perf/flops": done * world}   # the mean over ranks makes it a sum


def main(cfg: Config) -> None:
    from tqdm import tqdm

    console.quiet_libraries()
    run = setup(cfg)
    accelerator, tracker, val = run.accelerator, run.tracker, run.val
    if accelerator.is_main_process:
        console.header(cfg.model_path, param_share(run.actor)[1], accelerator.num_processes,
                       distributed.zero_stage(accelerator), run.engine.name, Path(cfg.output_dir),
                       getattr(tracker, "uri", ""), cfg.mlflow_experiment, cfg.total_training_steps)
    stop, guards = StopSignal(), run.guards
    optimizer_steps = cfg.ppo_epochs * (cfg.train_batch_size // cfg.ppo_mini_batch_size)
    status, final_dir, bar = "FAILED", None, None
    try:
        if val and cfg.val_before_train and not run.resumed:
            val_metrics, samples = run_validation(cfg, accelerator, run.engine, run.scorer, run.tokenizer, val)
            tracker.log(0, val_metrics)
            tracker.log_samples(0, samples)
        bar = tqdm(desc="ppo", initial=run.first_step - 1, total=cfg.total_training_steps,
                   disable=not accelerator.is_main_process)
        step = run.first_step
        while step <= cfg.total_training_steps:
            metrics = train_step(run, step)   # phases 1-7
            postfix = dict(score=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics.get('kl/mean', 0):.4f}",
                           step_s=f"{metrics['time/step_s']:.2f}")

            # 8 validate, log
            if val and cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == cfg.total_training_steps):
                start = time.perf_counter()
                val_metrics, samples = run_validation(cfg, accelerator, run.engine, run.scorer, run.tokenizer, val)
                metrics.update(val_metrics)
                metrics["time/val_s"] = time.perf_counter() - start
                tracker.log_samples(step, samples)
            metrics["guard/rollbacks"] = guards.rollbacks
            tracker.log(step, metrics)
            if "val/accuracy" in metrics:
                bar.last_val = f"{metrics['val/accuracy']:.3f}"
            bar.set_postfix(**postfix, **({"val_acc": bar.last_val} if getattr(bar, "last_val", None) else {}))
            if "val/accuracy" in metrics or "val/score_mean" in metrics:
                tracker.log_curves()

            # 8 guards: roll back to the last checkpoint on KL drift or a run of skipped steps
            reason = guards.check(step, metrics, optimizer_steps)
            if reason:
                state = guards.rollback(step, reason, lambda path, saved: restore(run, path, saved),
                                        *run.trained["actor"][1:], accelerator.is_main_process)
                run.engine.load_weights(actor_weights(run.actor, run.ds, cfg.rollout_sync_bucket_mb))
                tracker.rewind(tracker.history, state["step"])
                step = bar.n = run.first_step
                continue

            # 8 checkpoint (on its frequency, or when asked to stop)
            stopping = stop.agreed(accelerator)
            on_freq = cfg.save_freq > 0 and (step % cfg.save_freq == 0 or step == cfg.total_training_steps)
            if stopping or on_freq:
                save_checkpoint(accelerator, run.ds, cfg.output_dir, cfg.save_total_limit, step, run.trained, {
                    "config": dataclasses.asdict(cfg), "kl_ctrl": run.kl_ctrl.state_dict(),
                    "data": {"epoch": run.stream.epoch, "pos": run.stream.pos},
                    "sft_data": {"epoch": run.sft.rows.epoch, "pos": run.sft.rows.pos} if run.sft else None,
                    "mlflow_run_id": tracker.run_id, "rollbacks": guards.rollbacks,
                    "entropy_reaction": guards.entropy_reaction},
                    {"engine": run.engine.state_dict()})
            if stopping:
                bar.close()
                if accelerator.is_main_process:
                    print(f"stopped by a signal after step {step}; checkpoint saved, resume with the same command",
                          flush=True)
                status = "KILLED"
                return
            step += 1
            bar.update(1)

        final_dir = save_final(accelerator, run.actor, run.tokenizer, Path(cfg.output_dir), run.ds, cfg.lora_save_merged)
        status = "FINISHED"
        if accelerator.num_processes > 1:
            print(f"rank {accelerator.process_index}/{accelerator.num_processes}: peak memory {peak_memory_gb():.2f} "
                  "GiB", flush=True)
    finally:
        if bar is not None:
            bar.close()   # before anything else is printed, so the bar's last state stays one line
        tracker.finish(status, final_dir)
        if accelerator.is_main_process:
            console.summary(Path(cfg.output_dir), status, tracker.history, tracker.uri, cfg.mlflow_experiment,
                            tracker.run_id, peak_memory_gb())
        # a rank leaving on an error (or a second Ctrl-C) runs no collective: the others may be
        # inside a different one, and the launcher ends them once this process exits
        if status != "FAILED":
            accelerator.wait_for_everyone()
        run.engine.shutdown()   # vLLM's teardown may already destroy the process group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def is_truncated(responses: list[list[int]], eos_id: int, max_len: int) -> torch.Tensor:
    """[B] True where a response was cut at max_len without an EOS."""
    return torch.tensor([len(r) >= max_len and r[-1] != eos_id for r in responses])


def sampler_logprobs(logprobs: list[list[float]], mask) -> torch.Tensor:
    """The sampler's per-token log-probs, right-padded like the responses -> [B, R]."""
    sampler = torch.zeros_like(mask)
    for i, lp in enumerate(logprobs):
        sampler[i, :len(lp)] = torch.tensor(lp, dtype=sampler.dtype)
    return sampler


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch on this rank, or without a GPU the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def save_final(accelerator, actor, tokenizer, out_dir: Path, ds: bool, merged: bool = False) -> Path | None:
    """The actor in Hugging Face format; under ZeRO-3 the shards are gathered into full weights."""
    if ds:
        accelerator.state.select_deepspeed_plugin("actor")
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(actor)      # collective under ZeRO-3: every rank calls it
    model = accelerator.unwrap_model(actor)
    merged_state = None
    if merged and hasattr(model, "peft_config"):   # also a collective under ZeRO-3
        merged_state = {name: t.detach().cpu().clone() for name, t in actor_weights(actor, ds, 256.0)
                        if accelerator.is_main_process}
    if not accelerator.is_main_process:
        return None
    final_dir = out_dir / "final"
    model.save_pretrained(final_dir, state_dict=state, safe_serialization=True)   # LoRA: the adapter alone
    tokenizer.save_pretrained(final_dir)
    if merged_state is not None:
        base = model.get_base_model()
        config_only = base.config.__class__.from_dict(base.config.to_dict())
        type(base)(config_only).save_pretrained(final_dir / "merged", state_dict=merged_state, safe_serialization=True)
        tokenizer.save_pretrained(final_dir / "merged")
    return final_dir


def dry_run(cfg: Config) -> bool:
    """--dry_run: the config resolved, every file read (prompts tokenized and checked), the model
    configs read (not the weights), and the memory each rank will need, for the launched world
    size and for 1 and 8 -> whether it fits. Collective-free, so every rank of a launch may run it."""
    console.quiet_libraries()
    from transformers import AutoTokenizer
    for lib in ("accelerate", "mlflow"):   # the libraries a run imports: part of the measured baseline
        importlib.import_module(lib)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    check_world_size(cfg, world)
    stage, offload = distributed.launched_zero()
    tokenizer = load_tokenizer(cfg.model_path, AutoTokenizer)
    columns = Scorer(cfg, tokenizer, None).columns
    read = lambda files: load_prompts(files, cfg.prompt_key, tokenizer, cfg.max_prompt_length,   # noqa: E731
                                      cfg.prompt_truncation, columns, cfg.reward_fn)
    counts = {"train": len(read(cfg.train_files).ids)}
    if counts["train"] < cfg.train_batch_size:
        raise UserError(f"train_files hold {counts['train']} rows, fewer than train_batch_size={cfg.train_batch_size}")
    if cfg.val_files:
        counts["val"] = len(read(cfg.val_files).ids)
    if cfg.sft_files:
        counts["sft"] = len(load_sft(cfg, tokenizer)[0])
    shape = lambda key, path, kind, **kw: _load(key, path, preflight.model_shape, "model config", kind=kind, **kw)  # noqa: E731
    kl_ref = cfg.use_kl_in_reward or cfg.use_kl_loss
    gpu, host, baseline = preflight.machine()
    plan = preflight.Plan(
        actor=shape("model_path", cfg.model_path, "causal", lora_rank=cfg.lora_rank, lora_targets=cfg.lora_target_modules),
        critic=shape("critic_model_path", cfg.critic_model_path or cfg.model_path, "value")
        if cfg.adv_estimator == "gae" else None,
        ref=shape("ref_model_path", cfg.ref_model_path or cfg.model_path, "causal")
        if kl_ref and not cfg.lora_rank else None,
        reward=shape("reward_model_path", cfg.reward_model_path, "reward") if cfg.reward_model_path else None,
        worlds=[world] + [w for w in (1, 8) if w != world], zero_stage=stage,
        offload_optimizer=offload["optimizer"], offload_params=offload["param"],
        ref_offload=cfg.ref_offload, reward_offload=cfg.reward_offload, bf16=cfg.dtype == "bf16",
        micro_batch=schedule(cfg, "actor").micro_batch, critic_micro_batch=schedule(cfg, "critic").micro_batch,
        seq_len=cfg.max_prompt_length + cfg.max_response_length, response_len=cfg.max_response_length,
        gen_batch=cfg.rollout_micro_batch_size,
        gradient_checkpointing=cfg.gradient_checkpointing, critic_gradient_checkpointing=critic_checkpointing(cfg),
        engine=cfg.rollout_engine,
        gpu_memory_utilization=cfg.rollout_gpu_memory_utilization, kv_cache_gb=cfg.rollout_kv_cache_gb,
        gpu_bytes=gpu, host_bytes=host, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        baseline_bytes=baseline)
    if rank != 0:
        return True
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)
               if getattr(cfg, f.name) != f.default}
    print(f"config: {len(changed)} keys differ from the defaults: "
          + ", ".join(f"{k}={v}" for k, v in changed.items()))
    print("data: " + ", ".join(f"{n} {k} rows" for k, n in counts.items()) + "; every file read and checked")
    print(f"actor: {plan.actor.params / 1e6:.2f}M parameters ({plan.actor.trainable / 1e6:.2f}M trained), "
          f"vocabulary {plan.actor.vocab}")
    return preflight.report(plan)


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(config_docs.help_text(Config))
        sys.exit(0)
    try:
        if "--dry_run" in sys.argv[1:]:
            sys.exit(0 if dry_run(load_config([a for a in sys.argv[1:] if a != "--dry_run"])) else 1)
        main(load_config())
    except UserError as e:
        sys.exit(f"error: {e}")
