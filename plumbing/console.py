"""What the terminal shows: a short header before training, one progress bar, and at the end
where everything went and how to look at it. Third-party notices that tell the user nothing (the
critic's expected missing value head, per-model loading bars, DeepSpeed's CPU notice, MLflow's
table creation) are silenced; real warnings still show, from rank 0 only unless the problem is
another rank's own. train_ppo.py calls each function in one line with plain values.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path


def quiet_libraries() -> None:
    """Before the libraries load: keep their notices out of the terminal."""
    rank = int(os.environ.get("RANK", "0"))
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")   # else DeepSpeed says it found no GPU, on every rank
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()                      # "Loading weights" / "Writing model shards" bars
    from huggingface_hub.utils import disable_progress_bars
    disable_progress_bars()
    if rank != 0:   # the same library warning on every rank says nothing new
        hf_logging.set_verbosity_error()
        warnings.filterwarnings("ignore")
        for name in ("deepspeed", "DeepSpeed", "accelerate", "vllm"):
            logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def expected_missing_weights():
    """transformers prints a LOAD REPORT table for weights a checkpoint lacks; for a head this
    script adds on purpose (the critic's value head) that is noise. The caller checks what was
    missing itself (output_loading_info) and warns about anything else."""
    from transformers.utils import logging as hf_logging
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def header(model_path: str, params: int, world: int, zero_stage: int | None, engine: str, out_dir: Path,
           mlflow_uri: str, experiment: str, steps: int) -> None:
    zero = "no DeepSpeed" if zero_stage is None else f"DeepSpeed ZeRO-{zero_stage}"
    print(f"actor      {model_path} ({params / 1e6:.2f}M parameters)\n"
          f"processes  {world}, {zero}; rollout engine {engine}\n"
          f"output     {out_dir} ({steps} steps)\n"
          f"MLflow     {mlflow_uri or 'off'}, experiment {experiment!r}", flush=True)


def summary(out_dir: Path, status: str, history: list[dict], mlflow_uri: str, experiment: str,
            run_id: str | None, peak_gb: float, stop_reason: str | None = None) -> None:
    """Where the outputs are, the last validation figure and the command that opens MLflow's UI;
    stop_reason: which early stop ended the run, if one did."""
    last_val = next((r for r in reversed(history) if "val/accuracy" in r or "val/score_mean" in r), None)
    lines = [f"run {status.lower()} after step {history[-1]['step'] if history else 0}; peak memory of this "
             f"process {peak_gb:.2f} GiB"]
    if stop_reason:
        lines.append(f"  stopped early: {stop_reason}")
    if last_val:
        key = "val/accuracy" if "val/accuracy" in last_val else "val/score_mean"
        first = next(r[key] for r in history if key in r)
        lines.append(f"  {key} {last_val[key]:.4g} at step {last_val['step']} (started at {first:.4g})")
    for label, path in (("metrics", out_dir / "metrics.jsonl"), ("curves", out_dir / "curves.png"),
                        ("checkpoints", out_dir / "checkpoints"), ("model", out_dir / "final")):
        if path.exists():
            lines.append(f"  {label:<12}{path}")
    if run_id:
        lines.append(f"  {'MLflow':<12}run {run_id} in experiment {experiment!r}; open it with:")
        lines.append(f"    {ui_command(mlflow_uri)}")
    print("\n".join(lines), flush=True)


def ui_command(uri: str) -> str:
    """The command that shows this store's runs: `mlflow ui` for a local store (a relative sqlite
    path made absolute, so it works from any directory), the address itself for a server."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri} in a browser"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return f"mlflow ui --backend-store-uri {uri}"


def note(line: str) -> None:
    """One line on stderr, from the main process only (every rank decides the same)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {line}", file=sys.stderr, flush=True)
