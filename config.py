"""The config: one flat dataclass (each key typed, with a default and a one-line help), read as
defaults (the demo) <- YAML file(s) (--config) <- --key=value, then validated. The first module a
reader opens after train_ppo.py; it leans only on the math's names (kl/, core_algos) and errors.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import kl
from core_algos import LOSS_AGG_MODES, PF_PPO_METHODS, REWARD_PLACEMENTS
from errors import UserError


HERE = Path(__file__).resolve().parent


def opt(default, help: str):
    if isinstance(default, dict):   # a mutable default: each Config gets its own copy
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def default_of(f):
    """A Config field's default value (a dict-valued key's, through its factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


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
    reward_model_engine: str = opt("trained", "where reward_model_path runs: trained (a frozen DeepSpeed engine beside "
                                              "the trained models) | vllm (a vLLM pooling engine of its own)")
    reward_model_gpu_memory_utilization: float = opt(0.2, "reward_model_engine=vllm on GPU: its engine's share of GPU "
                                                          "memory (beside rollout_gpu_memory_utilization)")
    reward_model_kv_cache_gb: float = opt(0.25, "reward_model_engine=vllm on CPU: its engine's KV cache in GiB")
    # an LLM judge (generative reward model): rewards/judge.py
    reward_judge_path: str = opt("", "LLM judge: a causal LM that reads each sample (reward_judge_template) and writes "
                                     "a verdict that reward_judge_parser turns into the score; replaces reward_fn")
    reward_judge_template: str = opt("", "LLM judge: a Jinja file rendered with prompt, response and any dataset "
                                         "column, sent as the user's message through the judge's chat template")
    reward_judge_parser: str = opt("rewards.judge:score_in_range",
                                   "LLM judge: 'module:function' called as fn(verdict, row) -> score or None "
                                   "(unreadable); built in: rewards.judge:score_in_range, rewards.judge:prefer_a")
    reward_judge_range: str = opt("0,10", "LLM judge: 'low,high' of score_in_range's verdict (scaled to 0..1), given "
                                          "to a parser that takes judge_range")
    reward_judge_fallback: float = opt(0.0, "LLM judge: the score of a verdict the parser cannot read (counted in "
                                            "reward/judge_parse_errors)")
    reward_judge_max_tokens: int = opt(64, "LLM judge: longest verdict, in the judge's tokens")
    reward_judge_temperature: float = opt(0.0, "LLM judge: sampling temperature of the verdict; 0 = greedy")
    reward_judge_prompt_length: int = opt(2048, "LLM judge: longest judge prompt in the judge's tokens (longer ones "
                                                "get the fallback score, counted)")
    reward_judge_engine: str = opt("hf", "LLM judge: hf (a frozen copy, Hugging Face generate) | vllm (a vLLM "
                                         "engine of its own, asleep while the models train)")
    reward_judge_gpu_memory_utilization: float = opt(0.2, "LLM judge, vllm on GPU: the judge engine's share of GPU "
                                                          "memory (beside rollout_gpu_memory_utilization)")
    reward_judge_kv_cache_gb: float = opt(0.5, "LLM judge, vllm on CPU: the judge engine's KV cache in GiB")
    # reward shaping
    reward_clip: float = opt(0.0, "clip each sequence score to [-reward_clip, reward_clip] (after shaping); 0 = off")
    overlong_buffer_len: int = opt(0, "DAPO overlong shaping: penalise responses longer than max_response_length - this; 0 = off")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong shaping: the penalty at max_response_length")
    truncation_penalty: float = opt(0.0, "subtracted from the score of a response cut at max_response_length without EOS")
    reward_placement: str = opt("last", "where a sequence's (shaped) score lands, before KL and advantages: last (its "
                                        "last response token, verl's) | uniform (score / L on each of its L tokens) | "
                                        "decay (a token followed by k tokens gets score x reward_decay^k / (1 + "
                                        "reward_decay + ... + reward_decay^(L-1)): the total is kept)")
    reward_decay: float = opt(0.9, "reward_placement=decay: the factor in (0, 1] per token back from the last one "
                                   "(1 = uniform)")
    # dynamic sampling (DAPO, verl's algorithm.filter_groups)
    filter_groups_enable: bool = opt(False, "drop each prompt's group of rollout_n responses whose filter_groups_metric "
                                            "is the same for all (zero advantage) and sample more prompts until the "
                                            "batch holds train_batch_size groups")
    filter_groups_metric: str = opt("seq_reward", "what must vary within a group: seq_reward (the shaped score) | "
                                                  "score (the reward's raw score) | acc (verifier: score >= 1) | "
                                                  "seq_final_reward (after KL in the reward: needs "
                                                  "use_kl_in_reward=false, where it is seq_reward)")
    max_num_gen_batches: int = opt(0, "filter_groups: stop the run when a step's batch is not full after this many "
                                      "generation rounds; 0 = no limit")
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
    chat_template_kwargs: dict = opt({}, "keyword arguments for every chat template rendering (prompts, tool turns, "
                                         "validation), e.g. {enable_thinking: false}; on the command line as JSON")
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
    total_training_steps: int = opt(300, "PPO iterations (when total_epochs is 0)")
    total_epochs: int = opt(0, "passes over train_files: > 0 runs total_epochs x (rows // train_batch_size) steps, "
                               "counted at setup after prompt_truncation (verl's trainer.total_epochs); 0 = "
                               "total_training_steps")
    train_batch_size: int = opt(64, "prompts per iteration (all ranks together)")
    test_freq: int = opt(25, "validate every N steps (and after the last); -1 = never")
    val_before_train: bool = opt(True, "validate before the first step (logged as step 0)")
    save_freq: int = opt(-1, "checkpoint every N steps (also on SIGTERM/SIGINT, then exit); -1 = only on a signal")
    save_total_limit: int = opt(2, "keep only the newest K checkpoints")
    resume: str = opt("auto", "auto (newest complete checkpoint in output_dir/checkpoints) | never | a checkpoint path")
    malloc_mmap_threshold_mb: float = opt(0.0, "host blocks of this size and more go back to the OS when freed "
                                               "(glibc): less peak memory, slower steps (host_memory.py); 0 = freed blocks "
                                               "stay for reuse (no page faults); < 0 = glibc's own default")
    # guards
    kl_rollback_threshold: float = opt(0.0, "kl/mean above this reloads the last checkpoint with a lower actor lr; 0 = off")
    rollback_lr_factor: float = opt(0.5, "each rollback multiplies the actor's learning rate by this")
    max_rollbacks: int = opt(3, "give up (stop the run) after this many rollbacks")
    max_consecutive_skips: int = opt(5, "roll back after this many optimizer steps in a row skipped for a non-finite "
                                        "gradient norm; 0 = never")
    entropy_warn_threshold: float = opt(0.01, "warn when actor/entropy falls below this (entropy collapse; "
                                               "aggregated as loss_agg_mode: per token with token-mean); 0 = off")
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
    nan_clip_reaction: bool = opt(False, "after an actor step skipped for a non-finite gradient norm, clip the actor's "
                                         "gradients to nan_clip_max_grad_norm until nan_clip_clean_steps steps in a "
                                         "row had none")
    nan_clip_max_grad_norm: float = opt(0.5, "nan_clip_reaction: the actor's max_grad_norm while reacting")
    nan_clip_clean_steps: int = opt(10, "nan_clip_reaction: steps in a row without a skipped actor step that end the "
                                        "reaction")
    max_oom_retries: int = opt(3, "an out-of-memory error in the forward passes or an update is redone on every rank "
                                  "with micro-batches (or token budgets) 20% smaller, up to this many times in a "
                                  "row, then the run stops naming the keys to lower; 0 = off (the error ends the run)")
    early_stop_patience: int = opt(0, "stop (final checkpoint and model) when the validation score (val/accuracy, "
                                      "else val/score_mean) has not improved for this many validations; 0 = off")
    early_stop_loss_rtol: float = opt(0.0, "stop when the losses (actor/pg_loss, critic/vf_loss) change by less than "
                                           "this fraction step to step for early_stop_loss_steps steps in a row "
                                           "(e.g. 1e-4); 0 = off")
    early_stop_loss_steps: int = opt(10, "early_stop_loss_rtol: the steps in a row")
    skip_nonfinite_rewards: bool = opt(False, "a NaN/inf score drops that sample from the update instead of stopping the run")
    # tracking
    mlflow_tracking_uri: str = opt("", "MLflow tracking URI; '' = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir")
    mlflow_experiment: str = opt("ppo", "MLflow experiment name")
    run_name: str = opt("", "MLflow run name; '' = the output_dir's name")
    mlflow_system_metrics: bool = opt(False, "MLflow samples CPU, memory (and GPU) use of the machine into the run")
    mlflow_log_model: bool = opt(True, "log the final model to the MLflow run as a transformers model (a few "
                                       "seconds even for a tiny model); it is in output_dir/final either way")
    mlflow_registered_model_name: str = opt("", "register the final model as a new version of this name in MLflow's "
                                                "model registry, its model card as the description (needs "
                                                "mlflow_log_model); '' = not registered")
    mlflow_close_timeout_s: float = opt(60.0, "at the end of a run, how long to wait for an unreachable tracking "
                                              "server (MLflow's, and W&B's with wandb) to take the steps not sent "
                                              "yet (they are in metrics.jsonl either way)")
    wandb: bool = opt(False, "also log each step's metrics, the config and the validation samples to a Weights & "
                             "Biases run (project mlflow_experiment, name run_name, files under output_dir; "
                             "$WANDB_MODE=offline without network); MLflow stays on")
    log_samples: int = opt(16, "validation generations logged to MLflow (and W&B) as a table, per validation")
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
    rollout_max_num_batched_tokens: typing.Optional[int] = opt(None, "vllm: tokens the scheduler batches in one "
                                                                     "engine step; None = vLLM's default")
    rollout_max_num_seqs: typing.Optional[int] = opt(None, "vllm: sequences running at once in one engine; None = "
                                                           "vLLM's default")
    rollout_tensor_model_parallel_size: int = opt(1, "vllm on GPU: each engine spans this many consecutive ranks "
                                                     "(tensor parallel, one engine per group); 1 on CPU")
    rollout_fallback_hf: bool = opt(False, "vllm: if the engine cannot start, generate with the hf engine instead")
    rollout_max_logprob_diff: float = opt(0.0, "react when rollout/logprob_diff (sampler vs actor) exceeds this; "
                                               "0 = never")
    rollout_on_drift: str = opt("stop", "the reaction to rollout_max_logprob_diff: stop (the run, naming the step) | "
                                        "regenerate (re-send the weights and sample that step again with the hf "
                                        "engine, on-policy)")
    rollout_is: str = opt("off", "rollout correction, truncated importance sampling of the sampler against the actor "
                                 "(both under the top_p/top_k cut): off | token | sequence")
    rollout_is_threshold: float = opt(2.0, "rollout_is: the weights' cap C in min(exp(actor - sampler log-prob), C)")
    rollout_bypass_mode: bool = opt(False, "verl's rollout_correction.bypass_mode: the sampler's log-probs are the "
                                           "old log-probs, so the actor's no-grad pass is skipped (PPO's ratio is "
                                           "then against the sampler, as in TRL); actor/entropy comes from the "
                                           "update's first epoch, rollout/logprob_diff from its first mini-batch")
    rollout_mode: str = opt("colocated", "colocated (generate, then train, every step) | one_step_off (step t+1's "
                                         "batch is generated with the weights after step t-1 while step t trains) | "
                                         "async (the rollout side runs ahead, each batch at most max_staleness "
                                         "policy versions old); the asynchronous modes run rollout_engine in "
                                         "rollout_processes processes beside the launch (rollout/asynchronous.py)")
    rollout_processes: int = opt(1, "one_step_off/async: processes that run the rollout engine, each sampling a share of "
                                    "every batch; 0 = in training rank 0, one batch after the other (the same "
                                    "schedule without the overlap: a reference)")
    max_staleness: int = opt(1, "async: how many policy versions a batch's samples may lag the weights they train "
                                "(0 = on-policy, generated after the previous update)")
    partial_rollout: bool = opt(False, "async: a weight update interrupts generation and unfinished responses continue "
                                       "under the new weights (not built yet: false)")
    rollout_delay_s: float = opt(0.0, "one_step_off/async: the rollout side waits this long before each batch (a slow "
                                      "sampler, for tests and measurements); 0 = none")
    temperature: float = opt(1.0, "sampling temperature for rollouts; log-probs use the same temperature")
    top_p: float = opt(1.0, "nucleus sampling for rollouts")
    top_k: int = opt(-1, "top-k sampling for rollouts; -1 = off")
    val_temperature: float = opt(0.0, "sampling temperature for validation; 0 = greedy")
    val_batch_size: typing.Optional[int] = opt(
        None, "validation prompts generated and scored per round, all ranks together (ceil(val_batch_size / ranks) "
              "a rank, global as train_batch_size): bounds validation's memory, same metrics; None or 0 = one round")
    # multi-turn tools (rollout/tools/): the model calls tools mid-answer and reads their output
    tools: str = opt("", "tools the model may call, 'module:function' specs, comma-separated (or a YAML list), e.g. "
                         "rollout.tools.builtin:calculator; '' = single-turn rollouts")
    environment: str = opt("", "instead of tools: an environment class 'module:Class' with reset(prompt_row) and "
                               "step(text) -> (observation, reward, done), one instance per trajectory")
    max_turns: int = opt(4, "tools/environment: assistant turns per trajectory at most")
    tool_timeout_s: float = opt(30.0, "tools: wall-clock limit of one tool call (the python tool's too); past it "
                                      "the call is an error observation")
    tool_sandbox: str = opt("bwrap", "the python tool's sandbox: 'bwrap' (bubblewrap: fresh namespaces, no network, "
                                     "read-only runtime, a tmpfs as the only writable place; the run stops at startup "
                                     "where it cannot start) or 'none' (a plain subprocess with rlimits: warned, tagged)")
    tool_workers: int = opt(8, "tools/environment: tool calls (environment steps) run concurrently in this many threads")
    tool_overlap: bool = opt(True, "tools/environment: two halves of the trajectories take turns at the engine, so one "
                                   "half's tool calls run while the other half generates (twice the generate calls: "
                                   "pays off when tool calls take about as long as a turn's generation)")
    tool_call_bonus: float = opt(0.0, "tools/environment: added to the training score of a trajectory with at least "
                                      "one tool call that did not fail (not to reward/* metrics or validation)")
    # optimisation
    actor_lr: float = opt(5e-5, "actor learning rate (AdamW)")
    critic_lr: float = opt(1e-4, "critic learning rate (AdamW)")
    weight_decay: float = opt(0.0, "AdamW weight decay, actor and critic")
    lr_warmup_steps: int = opt(0, "linear learning-rate warmup over this many steps (actor and critic)")
    lr_warmup_steps_ratio: float = opt(0.0, "warmup as a fraction of total_training_steps, when lr_warmup_steps is 0 "
                                            "(verl's lr_warmup_steps_ratio)")
    critic_lr_warmup_steps_ratio: typing.Optional[float] = opt(None, "the critic's warmup fraction, when lr_warmup_steps "
                                                                     "is 0; None = lr_warmup_steps_ratio")
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
    ref_log_prob_micro_batch_size_per_device: typing.Optional[int] = opt(
        None, "sequences per micro-batch of the reference log-prob pass on one device; None = "
              "log_prob_micro_batch_size_per_device")
    reward_model_micro_batch_size_per_device: typing.Optional[int] = opt(
        None, "reward_model_engine=trained: sequences per reward-model forward pass on one device; None = "
              "log_prob_micro_batch_size_per_device")
    reward_model_use_dynamic_bsz: bool = opt(False, "reward_model_engine=trained: form the reward model's micro-batches "
                                                    "by token budget (reward_model_max_token_len_per_device) instead "
                                                    "of a sequence count")
    reward_model_max_token_len_per_device: typing.Optional[int] = opt(
        None, "reward_model_use_dynamic_bsz: prompt+response tokens per reward-model forward pass on one device; "
              "None = log_prob_max_token_len_per_device")
    log_prob_max_token_len_per_device: typing.Optional[int] = opt(
        None, "use_dynamic_bsz: tokens per micro-batch of the no-grad old and reference log-prob passes; None = "
              "ppo_max_token_len_per_device")
    ref_log_prob_max_token_len_per_device: typing.Optional[int] = opt(
        None, "use_dynamic_bsz: tokens per micro-batch of the reference log-prob pass; None = "
              "log_prob_max_token_len_per_device")
    use_dynamic_bsz: bool = opt(False, "form micro-batches by token budget instead of a sequence count")
    ppo_max_token_len_per_device: int = opt(16384, "use_dynamic_bsz: prompt+response tokens per micro-batch")
    remove_padding: bool = opt(True, "pack each micro-batch's sequences end to end in one row, so no layer computes "
                                     "on padding (verl's use_remove_padding); False = pad them to the longest")
    ulysses_sequence_parallel_size: int = opt(1, "Ulysses sequence parallelism (DeepSpeed's ALST): each group of "
                                                 "this many ranks holds the same sequences and splits every packed "
                                                 "row along its length, attention heads exchanged all-to-all (world "
                                                 "= data-parallel x this; needs remove_padding); 1 = off")
    critic_ppo_mini_batch_size: typing.Optional[int] = opt(None, "critic: prompts per optimizer step; None = ppo_mini_batch_size")
    critic_ppo_micro_batch_size_per_device: typing.Optional[int] = opt(
        None, "critic: sequences per forward/backward on one device; None = ppo_micro_batch_size_per_device")
    critic_ppo_epochs: typing.Optional[int] = opt(None, "critic: passes over each iteration's rollouts; None = ppo_epochs")
    critic_ppo_max_token_len_per_device: typing.Optional[int] = opt(
        None, "critic, use_dynamic_bsz: tokens per micro-batch; None = ppo_max_token_len_per_device")
    gradient_checkpointing: bool = opt(False, "recompute the actor's decoder layers (all but the last) in the backward "
                                              "pass instead of keeping their activations: less memory, more compute "
                                              "(a packed attention's outputs are kept, not recomputed)")
    critic_gradient_checkpointing: typing.Optional[bool] = opt(None, "the same for the critic; None = "
                                                                     "gradient_checkpointing")
    activation_offload: bool = opt(False, "with gradient checkpointing: the checkpointed layers' saved inputs wait in "
                                          "CPU memory during the update's forward, back on the device for the "
                                          "backward (verl's enable_activation_offload; actor and critic)")
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
    use_pf_ppo: bool = opt(False, "PF-PPO (gae): resample each rank's rollouts, with replacement, by weights "
                                  "from their scores before the update (verl's algorithm.use_pf_ppo)")
    pf_ppo_reweight_method: str = opt("pow", "PF-PPO weights: pow (|score|^pf_ppo_weight_pow) | max_min (only the "
                                             "best and worst scores) | max_random (best 0.4, others 0.1)")
    pf_ppo_weight_pow: float = opt(2.0, "PF-PPO: the power of the pow method")
    # losses
    clip_ratio: float = opt(0.2, "PPO clip range; the default for clip_ratio_low and clip_ratio_high")
    clip_ratio_low: typing.Optional[float] = opt(None, "lower clip range (ratio >= 1 - low); None = clip_ratio")
    clip_ratio_high: typing.Optional[float] = opt(None, "upper clip range (ratio <= 1 + high); None = clip_ratio")
    clip_ratio_c: float = opt(3.0, "dual-clip constant (> 1) bounding the loss where advantages are negative")
    cliprange_value: float = opt(0.5, "value clipping around the old values")
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient")
    loss_agg_mode: str = opt("token-mean", "token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm")


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
FILTER_GROUPS_METRICS = ("seq_reward", "score", "acc", "seq_final_reward")




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
    if cfg.rollout_bypass_mode and sampling_cut(cfg):
        notes.append(f"rollout_bypass_mode with top_p={cfg.top_p:g} / top_k={cfg.top_k}: the old log-probs are then "
                     "the sampler's of the cut, renormalised distribution and the update's are of the whole one, so "
                     "PPO's ratio starts at the probability the cut kept (below 1), and clipping sees that as a "
                     "policy change; kl/mean and the KL in the reward (old against ref) gain -log of that "
                     "probability per token too")
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
    if key == "tools" and isinstance(value, (list, tuple)):   # a YAML list of specs
        value = ",".join(str(v) for v in value)
    if kind is dict:
        return _mapping(key, value)
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


def _mapping(key: str, value) -> dict:
    """A dict-valued key: a YAML mapping, or JSON text (the command line), with string keys."""
    if value is None:
        return {}
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise UserError(f"config key {key!r} expects a mapping (JSON on the command line, e.g. "
                            f"--{key}='{{\"enable_thinking\": false}}'), got {value!r}: {e.msg}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise UserError(f"config key {key!r} expects a mapping with string keys, got {value!r}")
    return dict(value)


def validate_config(cfg: Config) -> None:
    """Everything checkable before a model loads; each message names the key and the value."""
    def need(ok, msg):
        if not ok:
            raise UserError(msg)

    for key in ("train_batch_size", "total_training_steps", "rollout_n", "ppo_epochs", "ppo_mini_batch_size",
                "ppo_micro_batch_size_per_device", "max_prompt_length", "max_response_length", "rollout_micro_batch_size"):
        need(getattr(cfg, key) > 0, f"{key} must be > 0, got {getattr(cfg, key)}")
    need(cfg.total_epochs >= 0, f"total_epochs must be >= 0 (0 = total_training_steps), got {cfg.total_epochs}")
    for key in ("rollout_max_num_batched_tokens", "rollout_max_num_seqs", "log_prob_max_token_len_per_device",
                "ref_log_prob_max_token_len_per_device", "reward_model_max_token_len_per_device"):
        need(getattr(cfg, key) is None or getattr(cfg, key) > 0, f"{key} must be > 0 (or None), got {getattr(cfg, key)}")
    need(cfg.rollout_tensor_model_parallel_size >= 1,
         f"rollout_tensor_model_parallel_size must be >= 1, got {cfg.rollout_tensor_model_parallel_size}")
    need(cfg.rollout_tensor_model_parallel_size == 1 or cfg.rollout_engine == "vllm",
         f"rollout_tensor_model_parallel_size={cfg.rollout_tensor_model_parallel_size} needs rollout_engine=vllm")
    sp = cfg.ulysses_sequence_parallel_size
    need(sp >= 1, f"ulysses_sequence_parallel_size must be >= 1, got {sp}")
    need(sp == 1 or cfg.remove_padding, f"ulysses_sequence_parallel_size={sp} splits packed rows: it needs "
                                        "remove_padding=true")
    need(not cfg.activation_offload or cfg.gradient_checkpointing or critic_checkpointing(cfg),
         "activation_offload moves what checkpointed layers keep: it needs gradient_checkpointing (or "
         "critic_gradient_checkpointing)")
    need(cfg.pf_ppo_reweight_method in PF_PPO_METHODS,
         f"pf_ppo_reweight_method must be one of {PF_PPO_METHODS}, got {cfg.pf_ppo_reweight_method!r}")
    need(not cfg.use_pf_ppo or cfg.adv_estimator == "gae",
         f"use_pf_ppo resamples GAE rollouts (as in verl): it needs adv_estimator=gae, got {cfg.adv_estimator!r}")
    need(cfg.clip_ratio_c > 1, f"clip_ratio_c must be > 1, got {cfg.clip_ratio_c}")
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
    need(not cfg.mlflow_registered_model_name or cfg.mlflow_log_model,
         f"mlflow_registered_model_name={cfg.mlflow_registered_model_name} registers the logged final model: it "
         "needs mlflow_log_model=true")
    need(cfg.save_total_limit > 0, f"save_total_limit must be > 0, got {cfg.save_total_limit}")
    need(cfg.resume in ("auto", "never") or Path(cfg.resume).is_dir(),
         f"resume must be auto, never or a checkpoint directory; {cfg.resume} does not exist")
    need(cfg.val_temperature >= 0, f"val_temperature must be >= 0, got {cfg.val_temperature}")
    need(cfg.val_batch_size is None or cfg.val_batch_size >= 0,
         f"val_batch_size must be >= 0 (0 or None = the whole val set at once), got {cfg.val_batch_size}")
    need(0 < cfg.top_p <= 1, f"top_p must be in (0, 1], got {cfg.top_p}")
    need(cfg.top_k == -1 or cfg.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {cfg.top_k}")
    for key in ("actor_lr", "critic_lr", "max_grad_norm", "critic_max_grad_norm", "rollout_kv_cache_gb",
                "rollout_sync_bucket_mb", "ppo_max_token_len_per_device"):
        need(getattr(cfg, key) > 0, f"{key} must be > 0, got {getattr(cfg, key)}")
    for key in ("lr_warmup_steps_ratio", "critic_lr_warmup_steps_ratio"):
        value = getattr(cfg, key)
        need(value is None or 0 <= value <= 1, f"{key} must be in [0, 1], got {value}")
    for key in ("weight_decay", "lr_warmup_steps", "critic_warmup", "kl_coef", "kl_loss_coef", "log_samples",
                "reward_clip"):
        need(getattr(cfg, key) >= 0, f"{key} must be >= 0, got {getattr(cfg, key)}")
    for key in ("gamma", "lam"):
        need(0 <= getattr(cfg, key) <= 1, f"{key} must be in [0, 1], got {getattr(cfg, key)}")
    need(cfg.rollout_on_drift in ("stop", "regenerate"),
         f"rollout_on_drift must be stop or regenerate, got {cfg.rollout_on_drift!r}")
    need(cfg.rollout_is in ("off", "token", "sequence"), f"rollout_is must be off, token or sequence, got {cfg.rollout_is!r}")
    need(cfg.rollout_is_threshold > 0, f"rollout_is_threshold must be > 0, got {cfg.rollout_is_threshold}")
    for key, off in (("rollout_is", "off"), ("rollout_max_logprob_diff", 0.0)):
        need(not cfg.rollout_bypass_mode or getattr(cfg, key) == off,
             f"rollout_bypass_mode=true takes the sampler's log-probs as the old ones, so there is no actor pass "
             f"before the update for {key}={getattr(cfg, key)!r} to compare them with: set {key}={off!r} (PPO's "
             f"ratio against the sampler is the correction in bypass mode), or rollout_bypass_mode=false")
    need(cfg.rollout_sleep_level in (1, 2), f"rollout_sleep_level must be 1 or 2, got {cfg.rollout_sleep_level}")
    need(0 < cfg.rollout_gpu_memory_utilization <= 1,
         f"rollout_gpu_memory_utilization must be in (0, 1], got {cfg.rollout_gpu_memory_utilization}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "cliprange_value"):
        value = getattr(cfg, key)
        need(value is None or value > 0, f"{key} must be > 0, got {value}")
    for key in ("critic_ppo_mini_batch_size", "critic_ppo_micro_batch_size_per_device", "critic_ppo_epochs",
                "critic_ppo_max_token_len_per_device", "log_prob_micro_batch_size_per_device",
                "reward_model_micro_batch_size_per_device", "ref_log_prob_micro_batch_size_per_device"):
        need(getattr(cfg, key) is None or getattr(cfg, key) > 0, f"{key} must be > 0 (or None), got {getattr(cfg, key)}")
    for role in ("actor", "critic"):
        sched, key = schedule(cfg, role), "ppo_mini_batch_size" if role == "actor" else "critic_ppo_mini_batch_size"
        need(cfg.train_batch_size % sched.mini_batch == 0,
             f"train_batch_size ({cfg.train_batch_size}) must be a multiple of {key} ({sched.mini_batch})")
        # the key the budget came from: the critic's own, or the actor's that a critic left at None takes
        budget = ("critic_" if role == "critic" and cfg.critic_ppo_max_token_len_per_device is not None
                  else "") + "ppo_max_token_len_per_device"
        sp = cfg.ulysses_sequence_parallel_size
        need(not cfg.use_dynamic_bsz or sched.max_tokens >= cfg.max_prompt_length + cfg.max_response_length,
             f"{budget}={getattr(cfg, budget)} (the {role}'s token budget)"
             + (f" x ulysses_sequence_parallel_size={sp} = {sched.max_tokens}" if sp > 1 else "")
             + f" must hold one whole sequence (max_prompt_length + max_response_length = "
               f"{cfg.max_prompt_length + cfg.max_response_length})")
    need(cfg.adv_estimator == "gae" or cfg.rollout_n > 1 or cfg.adv_estimator == "reinforce_plus_plus",
         f"adv_estimator={cfg.adv_estimator} compares samples of one prompt: set rollout_n > 1 (got {cfg.rollout_n})")
    need(not (cfg.tools and cfg.environment), f"set tools or environment, not both (tools={cfg.tools!r}, "
         f"environment={cfg.environment!r}): an environment runs its own tools")
    if cfg.tools or cfg.environment:
        need(cfg.max_turns > 0, f"max_turns must be > 0, got {cfg.max_turns}")
        need(cfg.tool_timeout_s > 0, f"tool_timeout_s must be > 0, got {cfg.tool_timeout_s}")
        need(cfg.tool_sandbox in ("bwrap", "none"), f"tool_sandbox must be 'bwrap' or 'none', got {cfg.tool_sandbox!r}")
        need(cfg.tool_workers > 0, f"tool_workers must be > 0, got {cfg.tool_workers}")
        need(not cfg.rollout_ignore_eos, "rollout_ignore_eos cannot run with tools or an environment: a turn ends at "
                                         "its end-of-turn token")
    need(cfg.reward_fn or cfg.reward_model_path, "set reward_fn ('module:function') or reward_model_path")
    validate_judge(cfg)
    for key in ("model_path", "critic_model_path", "ref_model_path", "reward_model_path", "reward_judge_path"):
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
    need(cfg.reward_placement in REWARD_PLACEMENTS,
         f"reward_placement must be one of {REWARD_PLACEMENTS}, got {cfg.reward_placement!r}")
    need(0 < cfg.reward_decay <= 1, f"reward_decay must be in (0, 1], got {cfg.reward_decay}")
    need(cfg.filter_groups_metric in FILTER_GROUPS_METRICS,
         f"filter_groups_metric must be one of {FILTER_GROUPS_METRICS}, got {cfg.filter_groups_metric!r}")
    need(cfg.max_num_gen_batches >= 0, f"max_num_gen_batches must be >= 0 (0 = no limit), got {cfg.max_num_gen_batches}")
    if cfg.filter_groups_enable:
        need(cfg.rollout_n > 1, f"filter_groups_enable keeps groups whose responses differ: set rollout_n > 1 (got "
                                f"{cfg.rollout_n})")
        need(not (cfg.filter_groups_metric == "seq_final_reward" and cfg.use_kl_in_reward),
             "filter_groups_metric=seq_final_reward with use_kl_in_reward=true: groups are chosen before the forward "
             "passes that give the KL, so use seq_reward, score or acc (or use_kl_in_reward=false)")
        need(not (cfg.tools or cfg.environment), "filter_groups_enable with tools/environment: dynamic sampling does "
             "not yet select multi-turn trajectories; turn one of them off")
    for key in ("max_oom_retries", "early_stop_patience", "early_stop_loss_rtol"):
        need(getattr(cfg, key) >= 0, f"{key} must be >= 0, got {getattr(cfg, key)}")
    for key in ("nan_clip_max_grad_norm", "nan_clip_clean_steps", "early_stop_loss_steps"):
        need(getattr(cfg, key) > 0, f"{key} must be > 0, got {getattr(cfg, key)}")
    need(cfg.sft_coef >= 0 and cfg.sft_batch_size >= 0,
         f"sft_coef and sft_batch_size must be >= 0, got {cfg.sft_coef} and {cfg.sft_batch_size}")
    for key in ("train_files", "val_files", "sft_files"):
        for path in _split_files(getattr(cfg, key)):
            need(not Path(path).is_dir(), f"{key}: {path} is a directory; give parquet or jsonl files, comma-separated")
            need(Path(path).is_file(), f"{key}: file {path} does not exist")
    need(_split_files(cfg.train_files), "train_files is empty: give at least one parquet or jsonl file")
    validate_rollout_mode(cfg)


def validate_judge(cfg: Config) -> None:
    """The reward's source keys: one source, and the LLM judge's own keys."""
    def need(ok, msg):
        if not ok:
            raise UserError(msg)

    need(cfg.reward_model_engine in ("trained", "vllm"),
         f"reward_model_engine must be trained or vllm, got {cfg.reward_model_engine!r}")
    need(cfg.reward_model_kv_cache_gb > 0, f"reward_model_kv_cache_gb must be > 0, got {cfg.reward_model_kv_cache_gb}")
    need(0 < cfg.reward_model_gpu_memory_utilization <= 1, "reward_model_gpu_memory_utilization must be in (0, 1], "
                                                           f"got {cfg.reward_model_gpu_memory_utilization}")
    need(cfg.reward_model_engine == "trained" or cfg.reward_model_path,
         f"reward_model_engine={cfg.reward_model_engine} serves reward_model_path, which is not set")
    if not cfg.reward_judge_path:
        return
    default_fn = default_of(next(f for f in dataclasses.fields(Config) if f.name == "reward_fn"))
    need(not cfg.reward_model_path, f"reward_judge_path={cfg.reward_judge_path} and reward_model_path="
                                    f"{cfg.reward_model_path}: the reward comes from one of them, set only one")
    need(cfg.reward_fn == default_fn, f"reward_judge_path={cfg.reward_judge_path} and reward_fn={cfg.reward_fn}: the "
                                      "judge's verdict is the reward, drop reward_fn (or reward_judge_path)")
    need(cfg.reward_judge_engine in ("hf", "vllm"),
         f"reward_judge_engine must be hf or vllm, got {cfg.reward_judge_engine!r}")
    for key in ("reward_judge_max_tokens", "reward_judge_prompt_length", "reward_judge_kv_cache_gb"):
        need(getattr(cfg, key) > 0, f"{key} must be > 0, got {getattr(cfg, key)}")
    need(cfg.reward_judge_temperature >= 0, f"reward_judge_temperature must be >= 0, got {cfg.reward_judge_temperature}")
    need(0 < cfg.reward_judge_gpu_memory_utilization <= 1, "reward_judge_gpu_memory_utilization must be in (0, 1], "
                                                           f"got {cfg.reward_judge_gpu_memory_utilization}")
    need(cfg.reward_judge_template, "reward_judge_path is set but reward_judge_template is empty: give a Jinja file "
                                    "rendered with prompt, response and any dataset column")
    need(Path(cfg.reward_judge_template).is_file(), f"reward_judge_template: file {cfg.reward_judge_template} does "
                                                    "not exist")


ROLLOUT_MODES = ("colocated", "one_step_off", "async")


def stale_samples(cfg: Config) -> bool:
    """A batch may have been sampled by older weights than the ones it trains (staleness >= 1)."""
    return cfg.rollout_mode == "one_step_off" or (cfg.rollout_mode == "async" and cfg.max_staleness >= 1)


def validate_rollout_mode(cfg: Config) -> None:
    """The asynchronous modes' keys, and what does not run in them yet (each refused by name)."""
    def need(ok, msg):
        if not ok:
            raise UserError(msg)

    mode = cfg.rollout_mode
    need(mode in ROLLOUT_MODES, f"rollout_mode must be one of {ROLLOUT_MODES}, got {mode!r}")
    need(cfg.rollout_processes >= 0, f"rollout_processes must be >= 0, got {cfg.rollout_processes}")
    need(cfg.max_staleness >= 0, f"max_staleness must be >= 0, got {cfg.max_staleness}")
    need(cfg.rollout_delay_s >= 0, f"rollout_delay_s must be >= 0, got {cfg.rollout_delay_s}")
    if mode == "colocated":
        return
    need(not cfg.partial_rollout, "partial_rollout=true is not built yet: a weight update waits for the batch being "
                                  "generated (set partial_rollout=false)")
    refused = (("rollout_tensor_model_parallel_size", cfg.rollout_tensor_model_parallel_size > 1, "a rollout process "
                "runs one engine on one device: set 1"),
               ("tools" if cfg.tools else "environment", bool(cfg.tools or cfg.environment), "multi-turn rollouts do not run on the rollout side yet: "
                "set rollout_mode=colocated"),
               ("filter_groups_enable", cfg.filter_groups_enable, "DAPO's dynamic sampling does not run on the rollout "
                "side yet: set rollout_mode=colocated"),
               ("ulysses_sequence_parallel_size", cfg.ulysses_sequence_parallel_size > 1, "sequence parallelism does "
                "not run with a rollout side yet: set rollout_mode=colocated"),
               ("rollout_max_logprob_diff", cfg.rollout_max_logprob_diff > 0, "with stale samples the drift measures "
                "the policy's lag, not the sampler; the reaction is not built for the asynchronous modes: set 0"),
               ("kl_rollback_threshold", cfg.kl_rollback_threshold > 0, "a rollback would leave batches in flight "
                "from the weights it discards; not built for the asynchronous modes: set 0"))
    for key, hit, why in refused:
        need(not hit, f"{key}={getattr(cfg, key)!r} with rollout_mode={mode}: {why}")
    need(not stale_samples(cfg) or cfg.rollout_bypass_mode or cfg.rollout_is != "off",
         f"rollout_mode={mode}" + (f" with max_staleness={cfg.max_staleness}" if mode == "async" else "")
         + ": samples may come from older weights, so the sampler's log-probs are the behaviour policy: set "
           "rollout_bypass_mode=true (PPO's ratio against the sampler) or rollout_is=token|sequence (truncated "
           "importance weights on the recomputed old log-probs)")


@dataclass(frozen=True)
class Schedule:
    """How one trained model goes over a step's rollouts; the critic may have its own, as in verl."""
    mini_batch: int      # prompts per optimizer step (all ranks)
    micro_batch: int     # sequences per forward/backward on one device
    epochs: int
    max_tokens: int      # use_dynamic_bsz: tokens per micro-batch of a data-parallel rank; 0 = by sequence count


def schedule(cfg: Config, role: str) -> Schedule:
    """role: actor | critic | log_prob (the no-grad log-prob passes' sizes) | ref (the reference
    log-prob pass's). A critic_ or log_prob_ key left at None takes the actor's value, a ref_ key
    the log_prob one. The token budgets are per device: a
    micro-batch split over a sequence-parallel group holds ulysses_sequence_parallel_size times as
    many tokens (verl's ppo_max_token_len_per_gpu x ulysses_sequence_parallel_size)."""
    sp = cfg.ulysses_sequence_parallel_size
    if role == "ref":
        log_prob = schedule(cfg, "log_prob")
        budget = cfg.ref_log_prob_max_token_len_per_device
        return Schedule(log_prob.mini_batch, cfg.ref_log_prob_micro_batch_size_per_device or log_prob.micro_batch, 1,
                        budget * sp if cfg.use_dynamic_bsz and budget else log_prob.max_tokens)
    if role == "log_prob":
        budget = cfg.log_prob_max_token_len_per_device or cfg.ppo_max_token_len_per_device
        return Schedule(cfg.ppo_mini_batch_size, cfg.log_prob_micro_batch_size_per_device or
                        cfg.ppo_micro_batch_size_per_device, 1, budget * sp if cfg.use_dynamic_bsz else 0)
    def own(key):
        value = getattr(cfg, f"critic_{key}") if role == "critic" else None
        return getattr(cfg, key) if value is None else value
    return Schedule(own("ppo_mini_batch_size"), own("ppo_micro_batch_size_per_device"), own("ppo_epochs"),
                    own("ppo_max_token_len_per_device") * sp if cfg.use_dynamic_bsz else 0)


def reward_micro_batch(cfg: Config) -> tuple[int, int]:
    """(sequences per forward pass, token budget per pass: 0 = by sequence count) of a reward model on the
    trained stack, in training and validation; the budget per device, x ulysses_sequence_parallel_size as
    the other passes' (verl's reward_model.use_dynamic_bsz is its own switch, as here)."""
    size = (cfg.reward_model_micro_batch_size_per_device or cfg.log_prob_micro_batch_size_per_device
            or cfg.ppo_micro_batch_size_per_device)
    budget = (cfg.reward_model_max_token_len_per_device or cfg.log_prob_max_token_len_per_device
              or cfg.ppo_max_token_len_per_device)
    return size, budget * cfg.ulysses_sequence_parallel_size if cfg.reward_model_use_dynamic_bsz else 0


def sampling_cut(cfg: Config) -> bool:
    """top_p / top_k cut the rollouts' sampling distribution (renormalised over what they keep)."""
    return cfg.top_p < 1 or cfg.top_k > 0


def critic_checkpointing(cfg: Config) -> bool:
    return cfg.gradient_checkpointing if cfg.critic_gradient_checkpointing is None else cfg.critic_gradient_checkpointing


def _split_files(files: str) -> list[str]:
    return [f.strip() for f in files.split(",") if f.strip()]


def total_steps(cfg: Config, rows: int) -> int:
    """The run's length in steps: with total_epochs, epochs x (rows // train_batch_size), as verl
    counts (its dataloader drops the last partial batch); else total_training_steps. Worked out at
    setup from the rows actually loaded (after prompt_truncation=drop) and never written back."""
    if not cfg.total_epochs:
        return cfg.total_training_steps
    if rows < cfg.train_batch_size:
        raise UserError(f"total_epochs={cfg.total_epochs}: train_files has {rows} usable rows, fewer than "
                        f"train_batch_size={cfg.train_batch_size}: not one step per epoch")
    return cfg.total_epochs * (rows // cfg.train_batch_size)
