"""--dry_run: everything a run reads, read and checked, and the memory it will need, without
loading weights or training.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path

from config import Config, critic_checkpointing, default_of, schedule
from distribution import plugins as distributed
from distribution.prepare import check_world_size
from errors import UserError
from modeling.loading import _load, load_tokenizer
from plumbing import console, phase_model, preflight
from prompts.sets import load_prompts, load_sft
from rewards.scoring import Scorer
from rollout.tools.rollouts import TRAJECTORY_COLUMNS, make_tool_rollouts


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
    tools = make_tool_rollouts(cfg, tokenizer)   # multi-turn: the tools load, the chat template passes the check
    # a trajectory provides what a multi-turn reward takes beyond the data (messages, tool_calls, ...)
    scorer = Scorer(cfg, tokenizer, None)   # the reward function, or the judge's template and parser, read
    columns = scorer.dataset_columns(TRAJECTORY_COLUMNS if tools else ())
    read = lambda files: load_prompts(files, cfg.prompt_key, tokenizer, cfg.max_prompt_length,   # noqa: E731
                                      cfg.prompt_truncation, columns, scorer.source, keep_rows=tools is not None,
                                      template_kwargs=cfg.chat_template_kwargs)
    longest_with_tools = 0

    def count(files: str) -> int:
        nonlocal longest_with_tools
        prompts = read(files)
        if tools:   # the prompt the policy sees carries the tools' descriptions, as the run renders it
            longest_with_tools = max([longest_with_tools] + [len(tools.prompt_ids(row, text))
                                                             for row, text in zip(prompts.rows, prompts.texts)])
        return len(prompts.ids)

    counts = {"train": count(cfg.train_files)}
    if counts["train"] < cfg.train_batch_size:
        raise UserError(f"train_files hold {counts['train']} rows, fewer than train_batch_size={cfg.train_batch_size}")
    if cfg.val_files:
        counts["val"] = count(cfg.val_files)
    if longest_with_tools > cfg.max_prompt_length:
        raise UserError(f"a prompt rendered with the tool schemas is {longest_with_tools} tokens > max_prompt_length="
                        f"{cfg.max_prompt_length}: raise max_prompt_length (it counts the tools' descriptions)")
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
        # the other world sizes shown: those the sequence-parallel groups divide
        worlds=[world] + [w for w in (1, 8) if w != world and w % cfg.ulysses_sequence_parallel_size == 0],
        zero_stage=stage, sp=cfg.ulysses_sequence_parallel_size,
        offload_optimizer=offload["optimizer"], offload_params=offload["param"],
        ref_offload=cfg.ref_offload, reward_offload=cfg.reward_offload, bf16=cfg.dtype == "bf16",
        micro_batch=schedule(cfg, "actor").micro_batch, critic_micro_batch=schedule(cfg, "critic").micro_batch,
        seq_len=cfg.max_prompt_length + cfg.max_response_length, response_len=cfg.max_response_length,
        gen_batch=cfg.rollout_micro_batch_size,
        gradient_checkpointing=cfg.gradient_checkpointing, critic_gradient_checkpointing=critic_checkpointing(cfg),
        engine=cfg.rollout_engine,
        gpu_memory_utilization=cfg.rollout_gpu_memory_utilization, kv_cache_gb=cfg.rollout_kv_cache_gb,
        gpu_bytes=gpu, host_bytes=host, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        baseline_bytes=baseline,
        judge=shape("reward_judge_path", cfg.reward_judge_path, "causal") if cfg.reward_judge_path else None,
        judge_engine=cfg.reward_judge_engine, judge_gpu_memory_utilization=cfg.reward_judge_gpu_memory_utilization,
        judge_kv_cache_gb=cfg.reward_judge_kv_cache_gb,
        judge_seq_len=cfg.reward_judge_prompt_length + cfg.reward_judge_max_tokens,
        served_reward=cfg.reward_model_engine == "vllm",
        served_gpu_memory_utilization=cfg.reward_model_gpu_memory_utilization,
        served_kv_cache_gb=cfg.reward_model_kv_cache_gb)
    if rank != 0:
        return True
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)
               if getattr(cfg, f.name) != default_of(f)}
    print(f"config: {len(changed)} keys differ from the defaults: "
          + ", ".join(f"{k}={v}" for k, v in changed.items()))
    print("data: " + ", ".join(f"{n} {k} rows" for k, n in counts.items()) + "; every file read and checked")
    if tools:
        print(f"tools: {', '.join(tools.names)}; chat template passes the prefix check; longest prompt with the "
              f"tool schemas {longest_with_tools} tokens (max_prompt_length={cfg.max_prompt_length})")
        if tools.sandbox:   # bwrap has started once by now (check_sandbox), or the run would have stopped
            print(f"python tool sandbox: {tools.sandbox}" + (" (started once here)" if tools.sandbox == "bwrap"
                                                             else f"; warning: {tools.sandbox_notes()[1][0]}"))
    print(f"actor: {plan.actor.params / 1e6:.2f}M parameters ({plan.actor.trainable / 1e6:.2f}M trained), "
          f"vocabulary {plan.actor.vocab}")
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if metrics.is_file():   # the last run's phase times -> each rollout_mode's step time; its peak memory per phase
        print("\n".join(phase_model.report(metrics) + phase_model.memory_report(metrics)))
    return preflight.report(plan)
