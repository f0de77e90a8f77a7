"""Tracking: metrics.jsonl (the output contract), MLflow (asynchronous, one call per step),
curves.png and, when asked, a Weights & Biases run. train_ppo.py calls `Tracker(...)` once and
then `log`, `log_samples`, `log_curves`, `rewind` and `finish`; everything here takes plain
values, never the script's config.

metrics.jsonl is the record: it is written and flushed before anything is sent to MLflow, and a
tracking server that is slow or down never stalls training (the sender retries in the
background and catches up when the server is back). W&B is a convenience beside them: a W&B
that cannot start or stops taking steps is said once on stderr and left out of the rest of the run.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

CURVES = ("reward/score_mean", "val/accuracy", "kl/mean", "actor/entropy", "critic/vf_loss", "time/step_s")


class Tracker:
    def __init__(self, out_dir: Path, enabled: bool, *, uri: str, experiment: str, run_name: str,
                 params: dict, tags: dict, datasets: dict[str, list[str]], system_metrics: bool = False,
                 resumed: dict | None = None, log_model: bool = True, registered_model_name: str = "",
                 close_timeout_s: float = 60.0, wandb: bool = False):
        """uri: '' = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db. params: the whole config.
        datasets: context (training, validation, ...) -> the files, logged as MLflow dataset inputs.
        system_metrics: MLflow's own CPU/memory/GPU sampling of this process's machine.
        log_model: the final model logged to the run at the end (else it is only in final/).
        registered_model_name: that model also registered as a new version of this name in
        MLflow's model registry, described by its model card ('' = not registered).
        close_timeout_s: how long finish() waits for an unreachable server to take unsent steps.
        wandb: also a W&B run (project `experiment`, the same name); its id is kept in checkpoints.
        resumed: a checkpoint's trainer state. Its steps stay in metrics.jsonl (later ones are
        dropped, to be written again) and its MLflow run (and W&B run) is continued when the store has it."""
        self.enabled, self.out_dir, self.run_id, self.uri = enabled, out_dir, None, ""
        self.wandb: WandbRun | None = None
        self.log_model, self.registered_model_name, self.model_uri = log_model, registered_model_name, ""
        self.close_timeout_s = close_timeout_s
        self.history: list[dict] = []
        self._changes = self._drawn = 0   # history's changes so far, and as of curves.png's last drawing
        if not enabled:
            return
        # a tracking server that stops answering must not stall training: few, short retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        import logging

        import mlflow
        logging.getLogger("mlflow").setLevel(logging.WARNING)   # not its table creation and new-experiment notes
        self.mlflow = mlflow
        self.uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(experiment)
        run_id = resumed.get("mlflow_run_id") if resumed else None
        with _outside_ipython():
            if run_id and _has_run(mlflow, run_id):
                self.run = mlflow.start_run(run_id=run_id, log_system_metrics=system_metrics)
            else:
                self.run = mlflow.start_run(run_name=run_name or out_dir.name, tags=tags,
                                            log_system_metrics=system_metrics)
            # one synchronous call: MLflow's asynchronous queue, once used, makes end_run wait up to
            # a second for its thread's next poll (a resumed run whose values changed keeps the first ones)
            self._try("the run's parameters", lambda: mlflow.log_params({k: str(v) for k, v in params.items()},
                                                                       synchronous=True))
            for context, files in datasets.items():
                for path in files:
                    self._try(f"dataset {path}", lambda: _log_dataset(mlflow, path, context))
        self.run_id = self.run.info.run_id
        self._try("config.yaml", lambda: mlflow.log_artifact(str(out_dir / "config.yaml")))
        self.sender = MetricSender(mlflow.MlflowClient(), self.run_id)
        if wandb:
            self.wandb = WandbRun.start(out_dir, experiment, run_name or out_dir.name, params,
                                        resumed.get("wandb_run_id") if resumed else None)
        path = out_dir / "metrics.jsonl"
        kept = []
        if resumed and path.exists():
            kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kept = [r for r in kept if r["step"] <= resumed["step"]]
        self.rewind(kept, resumed["step"] if resumed else -1)

    def rewind(self, records: list[dict], step: int):
        """Keep only the records up to `step` (a resume or a rollback rewrites what follows)."""
        if not self.enabled:
            return
        path = self.out_dir / "metrics.jsonl"
        if getattr(self, "metrics_file", None):
            self.metrics_file.close()
        self.history = [r for r in records if r["step"] <= step]
        self._changes += 1
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, path)   # never a truncated file, even if killed right here
        self.metrics_file = open(path, "a")

    def log(self, step: int, metrics: dict):
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self.history.append(record)
        self._changes += 1
        self.sender.put(step, {k: v for k, v in metrics.items() if math.isfinite(v)})
        if self.wandb:
            self.wandb.log(step, metrics)

    def log_samples(self, step: int, rows: dict):
        if self.enabled and rows["prompt"]:
            self._try(f"samples of step {step}", lambda: self.mlflow.log_table(
                data=rows, artifact_file=f"samples/step_{step:06d}.json"))
            if self.wandb:
                self.wandb.log_samples(step, rows)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.id if self.wandb else None

    def log_curves(self) -> Path | None:
        """Redraw curves.png from every step so far and send it (called at each validation)."""
        if not (self.enabled and self.history):
            return None
        if self._drawn == self._changes:   # nothing new since the last drawing (the run's end after a validation)
            return self.out_dir / "curves.png"
        curves = plot_curves(self.history, self.out_dir / "curves.png")
        if self._try("curves.png", lambda: self.mlflow.log_artifact(str(curves))):
            self._drawn = self._changes
        return curves

    def _try(self, what: str, call) -> bool:
        try:
            call()
            return True
        except Exception as e:   # the tracking store is a convenience; metrics.jsonl is the record
            print(f"warning: MLflow did not take {what}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return False

    def finish(self, status: str, final_dir: Path | None, stop_reason: str | None = None):
        """stop_reason: why a run ended before total_training_steps (early stop), as the run's tag."""
        if not self.enabled:
            return
        if stop_reason:
            self._try("the stop reason", lambda: self.mlflow.set_tag("stop_reason", stop_reason))
        self.metrics_file.close()
        self.log_curves()
        if final_dir is not None and self.log_model:
            if self._try("the final model", lambda: self._log_model(final_dir)) and self.registered_model_name:
                self._try(f"the model version of {self.registered_model_name!r}", lambda: self._register(final_dir))
        unsent = self.sender.close(timeout=self.close_timeout_s)
        if unsent:
            print(f"warning: MLflow never took the metrics of steps {unsent} (the tracking server was unreachable); "
                  f"they are all in {self.out_dir / 'metrics.jsonl'}", file=sys.stderr, flush=True)
        self._try("the end of the run", lambda: self.mlflow.end_run(status=status))
        if self.wandb:
            self.wandb.finish(status == "FINISHED", self.close_timeout_s)


    def _log_model(self, final_dir: Path) -> None:
        """As an MLflow transformers model when the flavour can take it (a full model with its
        config), so `mlflow.transformers.load_model(<run tag model_uri>)` gives a pipeline back;
        else (a LoRA adapter) as plain files under final/. Its URI goes in the run's tags."""
        if not (final_dir / "config.json").is_file():
            self.mlflow.log_artifacts(str(final_dir), artifact_path="final")
            self.model_uri = f"runs:/{self.run_id}/final"
            self.mlflow.set_tag("model_uri", self.model_uri)
            return
        from importlib.metadata import version

        import logging

        import mlflow.transformers
        # not its notes that a local directory has no model card or license on the hub
        logging.getLogger("mlflow.transformers").setLevel(logging.ERROR)
        info = mlflow.transformers.log_model(
            transformers_model=str(final_dir), name="model", task="text-generation",
            pip_requirements=[f"{lib}=={version(lib)}" for lib in ("torch", "transformers", "accelerate")])
        self.model_uri = info.model_uri
        self.mlflow.set_tag("model_uri", info.model_uri)

    def _register(self, final_dir: Path) -> None:
        """The logged final model as a new version in the model registry, its description the card's
        facts (plumbing/model_card.py); the version goes in the run's tags."""
        from mlflow.exceptions import MlflowException

        from plumbing.model_card import registry_description
        name, client = self.registered_model_name, self.mlflow.MlflowClient()
        card = final_dir / "README.md"
        description = registry_description(card.read_text()) if card.is_file() else ""
        if self.model_uri.startswith("models:/"):   # a transformers model: MLflow links the version to it
            version = self.mlflow.register_model(self.model_uri, name).version
            client.update_model_version(name, version, description=description)
        else:   # a LoRA adapter's files: register_model wants a logged model, so the version names their place
            try:
                client.create_registered_model(name)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            version = client.create_model_version(name, source=f"{self.run.info.artifact_uri}/final",
                                                  run_id=self.run_id, description=description).version
        self.mlflow.set_tag("registered_model", f"{name}/{version}")


class WandbRun:
    """The W&B run beside MLflow (verl's trainer.logger=[..., wandb]), on the main process: the
    config, each step's metrics.jsonl record, the validation samples. wandb is imported here only
    (half a second), never in a run that does not ask for it. $WANDB_MODE, $WANDB_DIR and the rest
    of W&B's environment apply; its files go under the output dir unless $WANDB_DIR says otherwise.
    A call that fails (no network at the start, no API key, a W&B process that died) is said once
    and W&B is left out of the rest of the run: metrics.jsonl is the record."""

    def __init__(self, run, wandb):
        self.run, self.wandb, self.id = run, wandb, run.id
        # W&B's steps only go forward: steps that a rollback or a resume from an earlier checkpoint
        # redoes keep in W&B what it took first (resumed online, run.step is past the last one taken)
        self.next_step = run.step

    @classmethod
    def start(cls, out_dir: Path, project: str, name: str, config: dict, run_id: str | None) -> WandbRun | None:
        try:
            import wandb
            dir_ = {} if os.environ.get("WANDB_DIR") else {"dir": str(out_dir)}
            # a resumed run continues the checkpoint's W&B run (run_id None: a new one)
            run = wandb.init(project=project, name=name, config=config, id=run_id, resume="allow", **dir_)
            return cls(run, wandb)
        except Exception as e:   # never a reason to stop training
            _warn_wandb("did not start a run", e)
            return None

    def log(self, step: int, metrics: dict) -> None:
        self._log(step, lambda: metrics)

    def log_samples(self, step: int, rows: dict) -> None:
        self._log(step, lambda: {"val/samples": self.wandb.Table(columns=list(rows),
                                                                  data=[list(r) for r in zip(*rows.values())])})

    def _log(self, step: int, values) -> None:
        if self.run is None or step < self.next_step:
            return
        try:
            self.run.log(values(), step=step)
            self.next_step = step
        except Exception as e:
            _warn_wandb("stopped taking steps", e)
            self.run = None

    def finish(self, ok: bool, timeout: float) -> None:
        """Ends the run (failed unless ok); an unreachable W&B server gets `timeout` seconds."""
        run = self.run
        if run is None:
            return

        def end():
            try:
                run.finish(exit_code=0 if ok else 1)
            except Exception as e:
                _warn_wandb("did not end its run", e)
        ended = threading.Thread(target=end, daemon=True)
        ended.start()
        ended.join(timeout)
        if ended.is_alive():
            print(f"warning: W&B did not end its run within {timeout:.0f} s; its files are in {run.dir} "
                  "(`wandb sync` sends them)", file=sys.stderr, flush=True)


def _warn_wandb(what: str, e: Exception) -> None:
    print(f"warning: W&B {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; it is left out of "
          "the rest of the run (metrics.jsonl is the record)", file=sys.stderr, flush=True)


def _log_dataset(mlflow, path: str, context: str) -> None:
    import warnings

    import mlflow.data
    import pandas as pd
    frame = pd.read_parquet(path) if path.endswith(".parquet") else pd.read_json(path, lines=True)
    with warnings.catch_warnings():   # a local path "can be interpreted in multiple ways" (all the same one)
        warnings.simplefilter("ignore")
        dataset = mlflow.data.from_pandas(frame, source=str(Path(path).resolve()), name=Path(path).name)
    mlflow.log_input(dataset, context=context)


class MetricSender:
    """Sends each step's metrics to MLflow from a background thread, one batch call per step, so a
    slow or unreachable tracking server never stalls training; what fails is kept and retried
    until it goes through, so MLflow catches up when the server is back."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id
        self.pending: list[tuple[int, dict]] = []
        self.lock, self.wake, self.closing = threading.Lock(), threading.Event(), False
        self.closed = threading.Event()   # set by close(): cuts a back-off wait short
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def put(self, step: int, metrics: dict):
        with self.lock:
            self.pending.append((step, metrics))
        self.wake.set()

    def _loop(self):
        from mlflow.entities import Metric
        backoff = 1.0
        while True:
            self.wake.wait(timeout=backoff)
            self.wake.clear()
            with self.lock:
                batch = list(self.pending)
            if not batch:
                if self.closing:
                    return
                continue
            now = int(time.time() * 1000)
            try:
                for step, metrics in batch:
                    self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()],
                                          synchronous=True)
                    with self.lock:
                        self.pending.remove((step, metrics))
                backoff = 1.0
            except Exception:
                # while the run trains, back off up to 30 s (put() wakes the loop every step anyway);
                # once the run is closing, retry every second so that a server back within close()'s
                # window gets everything (an uninterruptible 30 s sleep here could outlast it)
                backoff = 1.0 if self.closing else min(backoff * 2, 30.0)
                self.closed.wait(backoff)

    def close(self, timeout: float) -> list[int]:
        """Wait up to `timeout` seconds for everything to be sent -> the steps that were not."""
        self.closing = True
        self.closed.set()
        self.wake.set()
        self.thread.join(timeout)
        with self.lock:
            return [step for step, _ in self.pending]


def _has_run(mlflow, run_id: str) -> bool:
    try:
        mlflow.MlflowClient().get_run(run_id)
        return True
    except mlflow.exceptions.MlflowException:
        return False


@contextlib.contextmanager
def _outside_ipython():
    """MLflow's start_run asks whether it runs in a notebook (Jupyter, Databricks) by importing
    IPython: 1-2 s of a short run. A process that has not imported IPython is in no notebook, so
    for that call its import fails at once (ImportError, which MLflow reads as "not in one")."""
    if "IPython" in sys.modules:
        yield
        return
    sys.modules["IPython"] = None
    try:
        yield
    finally:
        if "IPython" in sys.modules and sys.modules["IPython"] is None:
            del sys.modules["IPython"]


def plot_curves(history: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, key in zip(axes.flat, CURVES):
        points = [(r["step"], r[key]) for r in history if key in r]
        if points:
            ax.plot(*zip(*points), marker="." if len(points) < 30 else None)
        ax.set_title(key, y=1.0)   # placed, not fitted above the tick labels: the same picture, sooner
        ax.set_xlabel("step")
    # fixed margins: tight_layout measures every label first, most of a drawing's time
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.94, wspace=0.28, hspace=0.42)
    fig.savefig(path)
    plt.close(fig)
    return path


def run_tags(world: int, zero_stage: int | None, engine: str, root: Path) -> dict:
    """Tags that say what ran: the git commit (when the code is a checkout), the world size, ZeRO
    stage, rollout engine and the versions of the libraries that decide the numbers."""
    from plumbing.model_card import git_commit, library_versions
    tags = {"world_size": str(world), "zero_stage": "none" if zero_stage is None else str(zero_stage),
            "rollout_engine": engine, **{f"version.{lib}": v for lib, v in library_versions().items()}}
    commit = git_commit(root).split()[0]
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit
    return tags
