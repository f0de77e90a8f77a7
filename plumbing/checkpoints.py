"""Checkpoints, resuming and stop signals: the plumbing train_ppo.py calls in one line each.

A checkpoint is `<output_dir>/checkpoints/step_N/`: the trained models and their optimizers
(DeepSpeed's own sharded checkpoints under DeepSpeed, one `<name>.pt` of tensors otherwise),
`rank_K.json` per rank (every RNG state and the rollout engine's sampling state, as plain JSON) and
`trainer_state.json` (step, config, schedules, KL controller, data position, ...), written last.
It is data, not code: every file is read as JSON or with `torch.load(weights_only=True)`, so a
tampered checkpoint is refused instead of running what it carries.

This module takes plain values (paths, dicts, the accelerator); it never imports train_ppo.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from config import Config
from errors import UserError, first_line
from forward.readouts import _unwrap
from rollout.sync import actor_weights

# what the guards advise changing (guards.py): none changes a tensor's shape or what a checkpoint
# holds, so a run a guard stopped resumes with the advised change (a new actor_lr rescales the
# restored schedule: guards.rescale_lr)
GUARD_ADVICE_KEYS = {"actor_lr", "kl_rollback_threshold", "max_rollbacks", "rollback_lr_factor", "max_consecutive_skips",
                     "rollout_on_drift", "rollout_max_logprob_diff", "max_oom_retries", "nan_clip_reaction",
                     "nan_clip_max_grad_norm", "nan_clip_clean_steps", "early_stop_patience", "early_stop_loss_rtol",
                     "early_stop_loss_steps",
                     # what the OOM stop advises lowering: the cut of the work, not what a checkpoint holds
                     "ppo_micro_batch_size_per_device", "log_prob_micro_batch_size_per_device",
                     "critic_ppo_micro_batch_size_per_device", "ppo_max_token_len_per_device",
                     "critic_ppo_max_token_len_per_device", "log_prob_max_token_len_per_device"}
# keys that may change between a checkpoint and its resumption; any other difference is refused
RESUMABLE_KEYS = {"total_training_steps", "save_freq", "save_total_limit", "resume", "test_freq", "val_before_train",
                  "mlflow_tracking_uri", "mlflow_experiment", "mlflow_log_model", "mlflow_registered_model_name",
                  "run_name", "log_samples", "output_dir", "wandb",
                  "rollout_micro_batch_size", "val_files", "val_temperature", "gradient_checkpointing", "peak_tflops",
                  "malloc_mmap_threshold_mb", "reward_model_micro_batch_size_per_device", "val_batch_size",
                  # how the no-grad passes are cut: the same numbers either way
                  "ref_log_prob_micro_batch_size_per_device", "ref_log_prob_max_token_len_per_device",
                  "reward_model_use_dynamic_bsz", "reward_model_max_token_len_per_device"} | GUARD_ADVICE_KEYS


def find_checkpoint(resume: str, output_dir: str) -> Path | None:
    """The checkpoint to resume from: an explicit path, or (resume=auto) the newest complete one in
    output_dir. Only a directory named step_N holding trainer_state.json is complete (both are
    written last)."""
    if resume == "never":
        return None
    if resume != "auto":
        if not (Path(resume) / "trainer_state.json").is_file():
            raise UserError(f"resume={resume} is not a complete checkpoint (no trainer_state.json)")
        return Path(resume)
    root = Path(output_dir) / "checkpoints"
    for path in root.glob(".tmp_step_*"):
        print(f"warning: skipping partial checkpoint {path} (a save was interrupted)", file=sys.stderr)
    for path in sorted(_step_dirs(root), key=_step_of, reverse=True):
        if (path / "trainer_state.json").is_file():
            return path
        print(f"warning: skipping incomplete checkpoint {path}", file=sys.stderr)
    return None


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {path}: trainer_state.json cannot be read ({e}); pass --resume=never or "
                        f"another checkpoint") from None


def _defaults() -> dict:
    return dataclasses.asdict(Config())


def check_resumable(config: dict, state: dict, path: Path) -> list[str]:
    """Refuses a checkpoint made with a different config (naming the keys) -> notes on the
    resumable keys that did change, for the log. total_training_steps sets the cosine
    schedule's length, so changing it is refused under that schedule."""
    # a key the checkpoint's config lacks was added to the toolkit since: that run used its default
    saved = {**_defaults(), **state["config"]}
    differing = [k for k in config if k not in RESUMABLE_KEYS and saved.get(k) != config[k]]
    steps_before, steps_now = saved.get("total_training_steps"), config["total_training_steps"]
    if steps_before != steps_now and config.get("lr_scheduler_type") == "cosine":
        differing.append("total_training_steps")
    if differing:
        listing = ", ".join(f"{k}: {saved.get(k)!r} -> {config[k]!r}" for k in differing)
        why = (" (total_training_steps sets the cosine schedule's length)" if "total_training_steps" in differing
               else "")
        raise UserError(f"checkpoint {path} was made with a different config ({listing}){why}; resume with the "
                        f"same settings, pick another output_dir, or pass --resume=never")
    return [f"{k} changed from {saved.get(k)!r} to {config[k]!r} since the checkpoint; using {config[k]!r}"
            + (" (a guard's setting: safe to change on resume)" if k in GUARD_ADVICE_KEYS else "")
            for k in sorted(RESUMABLE_KEYS) if k in config and k != "resume" and saved.get(k) != config[k]]


def save_checkpoint(accelerator, ds: bool, output_dir: str, keep: int, step: int, trained: dict, state: dict,
                    rank_state: dict) -> Path:
    """trained: name -> (model, optimizer, scheduler); state: the trainer state (plain JSON);
    rank_state: this rank's own plain-JSON state (e.g. the rollout engine's). Written to
    .tmp_step_N and renamed to step_N when every rank is done, so a crash mid-save never leaves a
    directory that looks complete; only the newest `keep` checkpoints stay."""
    started = time.perf_counter()
    root = Path(output_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    for name, (model, optim, _) in trained.items():
        if ds:   # each rank writes its own shards of the weights and optimizer state
            model.save_checkpoint(str(tmp / name), tag="state")
        elif accelerator.is_main_process:
            torch.save({"model": _unwrap(model).state_dict(), "optim": optim.state_dict()},
                       tmp / f"{name}.pt")
    (tmp / f"rank_{accelerator.process_index}.json").write_text(json.dumps({"rng": _rng_state(), **rank_state}))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        full = {"step": step, "world_size": accelerator.num_processes,
                "schedulers": {n: s.state_dict() for n, (_, _, s) in trained.items()}, **state}
        (tmp / "trainer_state.json").write_text(json.dumps(full))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(_step_dirs(root), key=_step_of)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"checkpoint {final} saved in {time.perf_counter() - started:.2f} s", flush=True)
    return final


def load_checkpoint(accelerator, ds: bool, path: Path, state: dict, trained: dict) -> dict:
    """Models, optimizers, schedules and this rank's RNGs from a checkpoint -> this rank's saved
    plain state (e.g. the rollout engine's)."""
    if state["world_size"] != accelerator.num_processes:
        raise UserError(f"checkpoint {path} was written by {state['world_size']} processes, this run has "
                        f"{accelerator.num_processes}: resume with the same num_processes")
    for name, (model, optim, sched) in trained.items():
        if ds:
            _check_deepspeed_shards(path / name / "state", state["world_size"])
            with _weights_only_deepspeed_load(path / name):
                model.load_checkpoint(str(path / name), tag="state", load_optimizer_states=True,
                                      load_lr_scheduler_states=False)
        else:
            saved = safe_load(path / f"{name}.pt", map_location=accelerator.device)
            try:
                _unwrap(model).load_state_dict(saved["model"])
                optim.load_state_dict(saved["optim"])
            except (KeyError, ValueError, RuntimeError) as e:   # another model's weights, or a foreign file
                # load_state_dict's first line only says "Error(s) in loading state_dict": the next names one
                detail = " ".join(line.strip() for line in str(e).strip().splitlines()[:2]) or type(e).__name__
                raise UserError(f"checkpoint file {path / f'{name}.pt'} does not fit this run's {name} ({detail}); "
                                "pass --resume=never or another checkpoint") from None
        sched.load_state_dict(state["schedulers"][name])
    file = path / f"rank_{accelerator.process_index}.json"
    try:
        mine = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {path}: {file.name} cannot be read ({e})") from None
    _set_rng_state(mine.pop("rng"))
    return mine


def _check_deepspeed_shards(where: Path, world: int) -> None:
    """DeepSpeed meets a missing or truncated shard with a bare AssertionError or a zip-reader
    error on the rank that reads it, while the other ranks wait in a collective. Every rank checks
    every rank's files here instead (a torch file is a zip archive: a truncated one has lost the
    directory at its end), so all reach the same verdict without a collective."""
    import zipfile
    files = sorted(where.glob("*.pt"))
    for rank in range(world):
        if not any(f"zero_pp_rank_{rank}_" in f.name for f in files):
            raise UserError(f"checkpoint {where.parent.parent}: {where} lacks the DeepSpeed shards of rank {rank}: the "
                            "checkpoint is damaged; pass --resume=never or another checkpoint")
    for file in files:
        if not zipfile.is_zipfile(file):
            raise UserError(f"checkpoint file {file} is truncated or not a torch file: the checkpoint is damaged; pass "
                            "--resume=never or another checkpoint")


def safe_load(file: Path, **kwargs):
    """torch.load of tensors and plain containers only; anything else (a pickled callable, a
    class) is refused with an error naming the file."""
    try:
        return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise _refused(file, e) from None
    except (OSError, RuntimeError, EOFError) as e:   # missing, truncated or not a torch file at all
        raise UserError(f"checkpoint file {file} cannot be read ({first_line(e)}): the checkpoint is damaged; pass "
                        "--resume=never or another checkpoint") from None


@contextmanager
def _weights_only_deepspeed_load(where: Path):
    """DeepSpeed reads its checkpoint files with torch.load(weights_only=False) and offers no
    switch; torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that call site. Besides tensors and
    plain containers, DeepSpeed's files hold three plain-data classes of its own: allowed by name."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    saved = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
            yield
    except pickle.UnpicklingError as e:
        raise _refused(where, e) from None
    finally:
        if saved is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved


def _refused(where: Path, error: Exception) -> UserError:
    # torch's message: a header line, then the offending global (e.g. "Unsupported global: GLOBAL io.open")
    lines = str(error).strip().splitlines()
    detail = lines[1].strip() if len(lines) > 1 else first_line(error)
    return UserError(f"checkpoint file {where} holds more than tensors and plain data, refused (a checkpoint is data, "
                     f"not code): {detail}")


def _rng_state() -> dict:
    """Every RNG this process samples with, as plain JSON."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist(),
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None}


def _set_rng_state(rng: dict) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])


def _step_dirs(root: Path) -> list[Path]:
    return [p for p in root.glob("step_*") if p.name.split("_", 1)[1].isdigit()]


def _step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


class StopSignal:
    """SIGTERM/SIGINT ask for a checkpoint at the end of the current step, then a clean exit; every
    rank stops together (agreed() is a collective each step). A second signal stops this rank at
    once: it raises KeyboardInterrupt, the script's exit path then runs no collective (so this rank
    never waits on the others), and the launcher ends the other ranks."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def agreed(self, accelerator) -> bool:
        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


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
