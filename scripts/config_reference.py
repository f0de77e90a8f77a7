"""Rewrite the docs' generated tables: the config reference (docs/config-reference.md, from
config.py's Config, the source of --help too), verl's keys (from scripts/verl_to_config.py's own
mapping) and TRL's PPOConfig fields (from TRL_FIELDS below; both in docs/migrating.md), so none of
them can drift from the code.

    python scripts/config_reference.py           # rewrite the pages in place
    python scripts/config_reference.py --check   # exit 1 if a page is out of date
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import config  # noqa: E402
from plumbing import config_docs  # noqa: E402
import verl_to_config as v2c  # noqa: E402

# TRL 1.x PPOConfig (and the TrainingArguments it inherits) -> (this toolkit's key, how). An empty
# key: no counterpart, and why.
TRL_FIELDS = {
    "sft_model_path": ("model_path", "the policy to start from; also the reference (ref_model_path '' = it)"),
    "reward_model_path": ("reward_model_path", "a sequence classifier with one label, as in TRL"),
    "learning_rate": ("actor_lr", "TRL trains policy and value head with one optimizer; here critic_lr is the critic's"),
    "num_ppo_epochs": ("ppo_epochs", ""),
    "num_mini_batches": ("ppo_mini_batch_size", "= train_batch_size / num_mini_batches"),
    "per_device_train_batch_size": ("train_batch_size", "TRL's batch = per_device x gradient_accumulation_steps x "
                                                        "processes prompts; here train_batch_size counts all of them"),
    "local_rollout_forward_batch_size": ("log_prob_micro_batch_size_per_device", "sequences per no-grad forward pass"),
    "response_length": ("max_response_length", ""),
    "temperature": ("temperature", ""),
    "missing_eos_penalty": ("truncation_penalty", "subtracted from the score of a response without EOS"),
    "kl_coef": ("kl_coef", "KL in the reward (use_kl_in_reward, the default), fixed coefficient"),
    "kl_estimator": ("kl_penalty", "k1 -> kl, k3 -> low_var_kl"),
    "cliprange": ("clip_ratio", ""),
    "cliprange_value": ("cliprange_value", ""),
    "gamma": ("gamma", ""),
    "lam": ("lam", ""),
    "whiten_rewards": ("", "not in verl's PPO: advantages are whitened (as in TRL), rewards are not"),
    "vf_coef": ("", "the critic is a separate model with its own optimizer (critic_lr), not a weighted loss term"),
    "stop_token": ("", "responses always stop at the tokenizer's EOS (rollout_ignore_eos to run on)"),
    "total_episodes": ("total_training_steps", "= total_episodes / train_batch_size"),
    "num_sample_generations": ("test_freq", "validation (with logged samples) every test_freq steps"),
    "model_adapter_name": ("lora_rank", "LoRA via PEFT; the reference is the base with adapters disabled"),
    "ref_adapter_name": ("", "the reference is always the base model with the adapters disabled"),
    "ds3_gather_for_generation": ("", "always: ZeRO-3 weights are gathered once per generation"),
    "seed": ("seed", ""),
    "output_dir": ("output_dir", ""),
    "max_grad_norm": ("max_grad_norm", "critic_max_grad_norm for the critic"),
    "weight_decay": ("weight_decay", ""),
    "warmup_steps": ("lr_warmup_steps", ""),
    "warmup_ratio": ("lr_warmup_steps_ratio", ""),
    "lr_scheduler_type": ("lr_scheduler_type", "constant or cosine (TRL's default linear is not offered)"),
    "bf16": ("dtype", "true -> bf16"),
    "gradient_checkpointing": ("gradient_checkpointing", "critic_gradient_checkpointing for the critic"),
    "save_steps": ("save_freq", ""),
    "eval_steps": ("test_freq", ""),
    "exp_name": ("run_name", "the MLflow run's name"),
    "report_to": ("", "always metrics.jsonl and MLflow (mlflow_tracking_uri, mlflow_experiment)"),
    "gradient_accumulation_steps": ("", "micro-batches accumulate into each PPO mini-batch by themselves"),
}


def config_table() -> str:
    """The config reference: every key of config.Config by section, as --help lists them."""
    out = []
    for section, fields in config_docs.sections(config.Config):
        out += [f"**{section}**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in fields:
            text = f.metadata["help"].replace("|", "\\|")
            out.append(f"| `{f.name}` | {config_docs.key_type(config.Config, f).replace('|', 'or')} | `{config_docs.key_default(f)}` | {text} |")
        out.append("")
    return "\n".join(out)


def trl_table() -> str:
    out = ["| TRL PPOConfig field | this toolkit | notes |", "|---|---|---|"]
    for field, (key, how) in TRL_FIELDS.items():
        out.append(f"| `{field}` | {f'`{key}`' if key else 'not carried'} | {how} |")
    return "\n".join(out)


def verl_table() -> str:
    out = ["| verl key | this toolkit | notes |", "|---|---|---|"]
    for key, target in v2c.MAPPING.items():
        name, convert = target if isinstance(target, tuple) else (target, None)
        note = (convert.__doc__ or "").strip() if convert else ""
        gate = f"only with {v2c.GATES[key]}=true" if key in v2c.GATES else ""
        out.append(f"| `{key}` | `{name}` | {'; '.join(n for n in (note, gate) if n)} |")
    out.append(f"| `trainer.logger` | `wandb` | {v2c.LOGGER_NOTE} |")
    for key, name in v2c.PER_GPU.items():
        out.append(f"| `{key}` | `{name}` | divided by trainer.n_gpus_per_node x trainer.nnodes |")
    for key, why in v2c.ALWAYS.items():
        out.append(f"| `{key}` | (any value) | nothing to set: {why} |")
    for key, (value, why) in v2c.FIXED_PATTERNS.items():
        out.append(f"| `{key}` | (only {value}) | nothing to set: {why} |")
    for key, value in v2c.FIXED.items():
        out.append(f"| `{key}` | (only {value}) | the toolkit's fixed behaviour |")
    for key, why in v2c.HINTS.items():
        out.append(f"| `{key}` | not carried | {why} |")
    return "\n".join(out)


# page (under docs/) -> the blocks it holds, each between <!-- name:start --> and <!-- name:end -->
PAGES = {"config-reference.md": {"config-reference": config_table},
         "migrating.md": {"verl-keys": verl_table, "trl-keys": trl_table}}


def render(text: str, blocks: dict) -> str:
    for name, make in blocks.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{make().rstrip()}\n{end}{tail}"
    return text


if __name__ == "__main__":
    stale = []
    for page, blocks in PAGES.items():
        path = ROOT / "docs" / page
        text = path.read_text()
        new = render(text, blocks)
        if new != text:
            stale.append(f"docs/{page}")
            if "--check" not in sys.argv[1:]:
                path.write_text(new)
    if "--check" in sys.argv[1:] and stale:
        sys.exit(f"{', '.join(stale)}: generated tables out of date: run python scripts/config_reference.py")
