"""The peer for scripts/bench.py: TRL 1.12.0's PPOTrainer on the workload train_ppo.py just ran.

    <peer venv>/bin/python scripts/bench_trl_peer.py --config runs/bench/w1/ours_1/config.yaml \
        --iterations 10 --out runs/bench/w1/peer_1

Runs in its own virtual environment (scripts/bench.py makes it: the system's packages plus
trl==1.12.0, the last TRL with a PPO trainer, which lives in trl.experimental.ppo). `--config` is the
resolved config.yaml that train_ppo.py wrote for the same workload, so both sides read one set of
values: the same policy / critic (value model) / reward model directories, the ref as a second copy
of the policy, batch, response length, PPO epochs and mini-batches, KL coefficient (k1, in the
reward), temperature, clip ranges, gamma, lambda, learning rate, seed, fp32.

Writes <out>/iterations.jsonl: one line per PPO iteration with step_s (time between two iterations'
ends, the first from the start of training) and the phases timed by wrapping TRL's own functions:
  gen_s      batch_generation (the policy's generate, with the logits that give the old log-probs)
  score_s    get_reward on the reward model
  forward_s  the other no-grad passes: ref log-probs (forward) and the value model's values (get_reward)
  update_s   from the first forward with gradients to the end of the iteration (4 epochs x mini-batches,
             then TRL's metrics and logging)
  other_s    the rest: data loading, response post-processing, rewards, GAE and whitening, and the
             cache clearing and gc.collect() TRL runs between iterations
plus TRL's logged metrics (objective/kl, objective/scores, ...) and response-shape checks.
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
        self.reset()
        self.checks = {"responses": 0, "short_responses": 0, "eos_tokens": 0, "eos_then_only_pad": 0}

    def reset(self):
        self.phases = {"gen_s": 0.0, "score_s": 0.0, "forward_s": 0.0}
        self.update_start = None

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
        """Fixed-length responses: every response is response_length tokens; an EOS does not stop it."""
        responses = query_responses[:, queries.shape[1]:]
        self.checks["responses"] += responses.shape[0]
        if responses.shape[1] < self.response_length:
            self.checks["short_responses"] += responses.shape[0]
        eos = responses == self.eos_id
        self.checks["eos_tokens"] += int(eos.sum())
        for row, hits in zip(responses, eos):
            if hits.any():
                first = int(hits.nonzero()[0])
                if first < len(row) - 1 and bool((row[first + 1:] == self.pad_id).all()):
                    self.checks["eos_then_only_pad"] += 1   # generation stopped at EOS


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
        row = {"step": state.global_step, "time/step_s": step_s, **{f"time/{k}": v for k, v in phases.items()},
               **{k: self.logs[k] for k in keep if k in self.logs}}
        if "objective/scores" in self.logs:   # in train_ppo.py's terms: KL per response token, mean score
            row["reward/score_mean"] = self.logs["objective/scores"]
            row["kl/mean"] = self.logs["objective/kl"] / args.response_length
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"peer iteration {state.global_step}: {step_s:.2f} s", flush=True)
        self.start = now
        self.clock.reset()


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
              "use_kl_loss": False, "rollout_ignore_eos": True, "dtype": "fp32", "entropy_coeff": 0.0}
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
        stop_token=None, stop_token_id=None,       # no stop token: EOS does not end a response
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
    clock = PhaseClock()
    for name in ("batch_generation", "forward", "get_reward"):
        clock.wrap(name)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=dataset, value_model=value, callbacks=[])
    clock.reward_model, clock.pad_id, clock.eos_id = trainer.reward_model, tokenizer.pad_token_id, tokenizer.eos_token_id
    clock.response_length = cfg["max_response_length"]
    timer = IterationTimer(clock, out / "iterations.jsonl")
    trainer.add_callback(timer)
    start = time.perf_counter()
    trainer.train()
    summary = {"trl": trl.__version__, "train_s": time.perf_counter() - start, **clock.checks,
               "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                 else trainer.optimizer).__name__}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("peer summary:", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
