"""The peer for scripts/bench.py: TRL 1.12.0's PPOTrainer on the workload train_ppo.py just ran.

    <peer venv>/bin/python scripts/bench_trl_peer.py --config runs/bench/w1/ours_1/config.yaml \
        --iterations 10 --out runs/bench/w1/peer_1

Runs in its own virtual environment (scripts/bench.py makes it: the system's packages plus
trl==1.12.0, the last TRL with a PPO trainer, which lives in trl.experimental.ppo). `--config` is the
resolved config.yaml that train_ppo.py wrote for the same workload, so both sides read one set of
values: the same policy / critic (value model) / reward model directories, the ref as a second copy
of the policy, batch, response length, PPO epochs and mini-batches, KL coefficient (k1, in the
reward), temperature, clip ranges, gamma, lambda, learning rate, seed, fp32, and whether responses end
at EOS: with rollout_ignore_eos (W1, W3) TRL gets no stop token and every response is response_length
tokens; without it (W5) TRL's stop_token="eos" stops generation at EOS and truncates each response after
its first EOS, as TRL does. Gradient checkpointing: TRL 1.12's PPOTrainer never applies its
args.gradient_checkpointing (its own train() replaces Trainer.train(), where that happens), so with
gradient_checkpointing in the config this script turns it on for the policy and, with
critic_gradient_checkpointing (None = the same), the value model, as train_ppo.py does for actor and
critic. TRL generates with the policy in training mode, where transformers' checkpointed layers drop
the KV cache (each new token would attend to itself alone), so the generation then runs in eval mode
(TRL disables dropout anyway: nothing else changes). TRL has no token-budget micro-batches and no
packing (use_dynamic_bsz, remove_padding): it pads every batch to its longest sequence, which is what
W5 compares.

Writes <out>/iterations.jsonl: one line per PPO iteration with step_s (time between two iterations'
ends, the first from the start of training) and the phases timed by wrapping TRL's own functions:
  gen_s      batch_generation (the policy's generate, with the logits that give the old log-probs)
  score_s    get_reward on the reward model
  forward_s  the other no-grad passes: ref log-probs (forward) and the value model's values (get_reward)
  update_s   from the first forward with gradients to the end of the iteration (4 epochs x mini-batches,
             then TRL's metrics and logging)
  other_s    the rest: data loading, response post-processing, rewards, GAE and whitening, and the
             cache clearing and gc.collect() TRL runs between iterations
plus the iteration's mean response length (tokens up to and including EOS, or response_length without
one; rollout/response_len_mean in train_ppo.py's terms), TRL's logged metrics (objective/kl,
objective/scores, ...) and response-shape checks.
"""
import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

import trl
from trl.experimental.ppo import PPOConfig, PPOTrainer
from trl.experimental.ppo import ppo_trainer as ppo_module


class PhaseClock:
    """Times TRL's phases by wrapping the module-level functions PPOTrainer.train() calls."""

    def __init__(self):
        self.reward_model = None
        self.pad_id = None
        self.response_length = None
        self.fixed_length = True
        self.reset()
        self.checks = {"responses": 0, "short_responses": 0, "eos_tokens": 0, "eos_then_only_pad": 0,
                       "pad_before_eos": 0, "response_lengths": []}

    def reset(self):
        self.phases = {"gen_s": 0.0, "score_s": 0.0, "forward_s": 0.0}
        self.update_start = None
        self.lengths = []

    def wrap(self, name: str):
        original = getattr(ppo_module, name)

        def timed(*args, **kwargs):
            if torch.is_grad_enabled():   # the PPO update's forward passes
                if self.update_start is None:
                    self.update_start = time.perf_counter()
                return original(*args, **kwargs)
            start = time.perf_counter()
            result = original(*args, **kwargs)
            elapsed = time.perf_counter() - start
            if name == "batch_generation":
                self.phases["gen_s"] += elapsed
                self._check_responses(args[1], result[0])
            elif name == "get_reward" and args[0] is self.reward_model:
                self.phases["score_s"] += elapsed
            else:
                self.phases["forward_s"] += elapsed
            return result

        setattr(ppo_module, name, timed)

    def _check_responses(self, queries, query_responses):
        """Each response's length; with fixed_length, counts what would show it was not: short responses, or
        generation stopped at an EOS. A sampled pad before EOS is counted (TRL would read it as the end)."""
        responses = query_responses[:, queries.shape[1]:]
        self.checks["responses"] += responses.shape[0]
        if responses.shape[1] < self.response_length:
            self.checks["short_responses"] += responses.shape[0]
        eos = responses == self.eos_id
        self.checks["eos_tokens"] += int(eos.sum())
        for row, hits in zip(responses, eos):
            length = len(row)
            if hits.any():
                first = int(hits.nonzero()[0])
                if first < len(row) - 1 and bool((row[first + 1:] == self.pad_id).all()):
                    self.checks["eos_then_only_pad"] += 1   # generation stopped at EOS
                if not self.fixed_length:
                    length = first + 1
            self.checks["pad_before_eos"] += int(bool((row[:length] == self.pad_id).any()))
            self.lengths.append(length)
        self.checks["response_lengths"] += self.lengths[-responses.shape[0]:]


class IterationTimer(TrainerCallback):
    def __init__(self, clock: PhaseClock, path: Path):
        self.clock, self.path, self.logs = clock, path, {}
        self.path.write_text("")

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        self.clock.reset()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs = dict(logs or {})

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        phases = dict(self.clock.phases)
        phases["update_s"] = now - self.clock.update_start if self.clock.update_start else 0.0
        step_s = now - self.start
        phases["other_s"] = step_s - sum(phases.values())
        keep = ("objective/kl", "objective/scores", "objective/rlhf_reward", "objective/entropy",
                "policy/approxkl_avg", "loss/policy_avg", "loss/value_avg", "val/num_eos_tokens")
        mean_len = sum(self.clock.lengths) / len(self.clock.lengths) if self.clock.lengths else float("nan")
        row = {"step": state.global_step, "time/step_s": step_s, **{f"time/{k}": v for k, v in phases.items()},
               "rollout/response_len_mean": mean_len, **{k: self.logs[k] for k in keep if k in self.logs}}
        if "objective/scores" in self.logs:   # in train_ppo.py's terms: KL per response token, mean score
            row["reward/score_mean"] = self.logs["objective/scores"]
            row["kl/mean"] = self.logs["objective/kl"] / mean_len   # objective/kl: the mean of per-response sums
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"peer iteration {state.global_step}: {step_s:.2f} s", flush=True)
        self.start = now
        self.clock.reset()


def generate_in_eval_mode():
    """TRL's batch_generation(model, ...) with the model in eval mode for the call: a checkpointed layer in
    training mode drops the KV cache (transformers' GradientCheckpointingLayer)."""
    original = ppo_module.batch_generation

    def in_eval(model, *args, **kwargs):
        was_training = model.training
        model.eval()
        try:
            return original(model, *args, **kwargs)
        finally:
            model.train(was_training)

    ppo_module.batch_generation = in_eval


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="the config.yaml train_ppo.py wrote for this workload")
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assert trl.__version__ == "1.12.0", f"the peer is TRL 1.12.0, this is {trl.__version__}"
    refuse = {"rollout_n": 1, "adv_estimator": "gae", "use_kl_in_reward": True, "kl_ctrl_type": "fixed",
              "use_kl_loss": False, "dtype": "fp32", "entropy_coeff": 0.0}
    for key, want in refuse.items():
        if cfg[key] != want:
            raise SystemExit(f"bench_trl_peer: {key}={cfg[key]!r}; the TRL peer only mirrors {key}={want!r}")
    if cfg["kl_penalty"] not in ("kl", "k1"):
        raise SystemExit(f"bench_trl_peer: kl_penalty={cfg['kl_penalty']!r}; TRL's in-reward KL is k1 here")
    batch = cfg["train_batch_size"]
    mini = cfg["ppo_mini_batch_size"]
    if batch % mini or cfg["ppo_micro_batch_size_per_device"] < mini:
        raise SystemExit("bench_trl_peer: needs whole mini-batches, each one micro-batch")
    torch.manual_seed(cfg["seed"])

    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    tokenizer.padding_side = "left"   # TRL's queries are left-padded (generation continues at the right)
    f32 = dict(dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(cfg["model_path"], **f32)
    ref = AutoModelForCausalLM.from_pretrained(cfg["ref_model_path"] or cfg["model_path"], **f32)
    value = AutoModelForSequenceClassification.from_pretrained(
        cfg["critic_model_path"] or cfg["reward_model_path"], num_labels=1, **f32)
    reward = AutoModelForSequenceClassification.from_pretrained(cfg["reward_model_path"], num_labels=1, **f32)
    for model in (policy, ref, value, reward):
        model.config.pad_token_id = tokenizer.pad_token_id
    critic_ckpt = cfg["gradient_checkpointing"] if cfg.get("critic_gradient_checkpointing") is None \
        else cfg["critic_gradient_checkpointing"]
    for model, on in ((policy, cfg["gradient_checkpointing"]), (value, critic_ckpt)):
        if on:   # as train_ppo.py does (modeling/loading.py); TRL itself would not (see the docstring)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    frames = [pd.read_parquet(p) if p.endswith(".parquet") else pd.read_json(p, lines=True)
              for p in cfg["train_files"].split(",")]
    prompts = pd.concat(frames)[cfg["prompt_key"]].tolist()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    dataset = Dataset.from_dict({"input_ids": ids})

    config = PPOConfig(
        output_dir=str(out / "trl"),
        # One batch of `batch` prompts per iteration, split into batch/mini mini-batches of one micro-batch
        # each, one optimizer step per mini-batch (gradient_accumulation_steps 1: TRL's micro-batch loop then
        # covers each whole mini-batch).
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_mini_batches=batch // mini,
        num_ppo_epochs=cfg["ppo_epochs"],
        local_rollout_forward_batch_size=batch,   # one generate() call for the batch, as train_ppo.py's hf engine
        total_episodes=args.iterations * batch,
        response_length=cfg["max_response_length"],
        # rollout_ignore_eos: no stop token, EOS does not end a response; else EOS ends it (TRL truncates there)
        stop_token=None if cfg["rollout_ignore_eos"] else "eos", stop_token_id=None,
        missing_eos_penalty=None,
        temperature=cfg["temperature"],
        kl_coef=cfg["kl_coef"], kl_estimator="k1",
        cliprange=cfg["clip_ratio"], cliprange_value=cfg["cliprange_value"],
        gamma=cfg["gamma"], lam=cfg["lam"],
        whiten_rewards=False,
        learning_rate=cfg["actor_lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg["weight_decay"],
        bf16=False, fp16=False, gradient_checkpointing=cfg["gradient_checkpointing"],
        num_sample_generations=0, eval_strategy="no", save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, seed=cfg["seed"], dataloader_num_workers=0,
    )
    if cfg["gradient_checkpointing"]:
        generate_in_eval_mode()
    clock = PhaseClock()
    for name in ("batch_generation", "forward", "get_reward"):
        clock.wrap(name)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=dataset, value_model=value, callbacks=[])
    clock.reward_model, clock.pad_id, clock.eos_id = trainer.reward_model, tokenizer.pad_token_id, tokenizer.eos_token_id
    clock.response_length, clock.fixed_length = cfg["max_response_length"], cfg["rollout_ignore_eos"]
    timer = IterationTimer(clock, out / "iterations.jsonl")
    trainer.add_callback(timer)
    start = time.perf_counter()
    trainer.train()
    summary = {"trl": trl.__version__, "train_s": time.perf_counter() - start, "fixed_length": clock.fixed_length,
               "gradient_checkpointing": [policy.is_gradient_checkpointing, value.is_gradient_checkpointing],
               **clock.checks,
               "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                 else trainer.optimizer).__name__}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("peer summary:", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
