"""The Tracker on a real SQLite MLflow store, in process: what it draws and sends."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mlflow_store import sqlite_uri
from plumbing.tracking import Tracker


def test_curves_are_redrawn_only_after_the_history_changed(tmp_path):
    """curves.png is drawn at each validation and at the end; the end right after a validation
    (no step since) keeps the drawing, a new step or a rewind (resume, rollback) redraws it."""
    import mlflow
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("a: 1\n")
    tracker = Tracker(out, True, uri=sqlite_uri(tmp_path), experiment="e", run_name="r", params={"a": 1}, tags={},
                      datasets={}, log_model=False)
    curves: Path = out / "curves.png"

    def drawn_again(action) -> bool:
        curves.unlink(missing_ok=True)
        action()
        return curves.exists()

    tracker.log(1, {"reward/score_mean": 0.5})
    assert drawn_again(tracker.log_curves)
    assert not drawn_again(tracker.log_curves)
    tracker.log(2, {"reward/score_mean": 0.7})
    assert drawn_again(tracker.log_curves)
    tracker.rewind(tracker.history, 1)   # same length as a rollback followed by one new step
    tracker.log(2, {"reward/score_mean": 0.1})
    assert drawn_again(tracker.log_curves)
    assert not drawn_again(lambda: tracker.finish("FINISHED", None))   # the end right after a drawing
    run = mlflow.MlflowClient(sqlite_uri(tmp_path)).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"


def test_parameters_are_stored_at_the_start_and_a_resumed_run_with_other_values_is_said_once(tmp_path, capsys):
    """The config goes to MLflow in one synchronous call as the tracker starts, never through MLflow's
    asynchronous queue (whose thread, once started, makes every end_run wait up to a second for its
    next poll). A resumed run whose values changed keeps the first ones, says so once and goes on."""
    import threading

    import mlflow
    client = mlflow.MlflowClient(sqlite_uri(tmp_path))

    def tracker(out: Path, params: dict, resumed=None) -> Tracker:
        out.mkdir(exist_ok=True)
        (out / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in params.items()))
        return Tracker(out, True, uri=sqlite_uri(tmp_path), experiment="e", run_name="r", params=params, tags={},
                       datasets={}, log_model=False, resumed=resumed)
    first = tracker(tmp_path / "out", {"a": 1, "b": "x"})
    assert client.get_run(first.run_id).data.params == {"a": "1", "b": "x"}   # already, before any step
    first.log(1, {"reward/score_mean": 0.5})
    assert "MLflowAsyncLoggingLoop" not in [t.name for t in threading.enumerate()]
    first.finish("FINISHED", None)
    capsys.readouterr()
    again = tracker(tmp_path / "out", {"a": 1, "b": "y"}, resumed={"mlflow_run_id": first.run_id, "step": 1})
    assert again.run_id == first.run_id
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and "the run's parameters" in said[0], said
    again.log(2, {"reward/score_mean": 0.7})
    again.finish("FINISHED", None)
    run = client.get_run(first.run_id)
    assert run.data.params == {"a": "1", "b": "x"} and run.info.status == "FINISHED"


def test_a_wandb_that_cannot_start_is_said_and_the_run_goes_on(tmp_path):
    """wandb=true with W&B online and no API key anywhere (W&B refuses at once): one warning line,
    every step still in metrics.jsonl and MLflow, and the run ends FINISHED. In a fresh process, so
    that W&B's settings come from this environment (wandb caches them per process)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("a: 1\n")
    uri = sqlite_uri(tmp_path)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from plumbing.tracking import Tracker
        tracker = Tracker(Path({str(out)!r}), True, uri={uri!r}, experiment="e", run_name="r", params={{"a": 1}},
                          tags={{}}, datasets={{}}, log_model=False, wandb=True)
        assert tracker.wandb is None and tracker.wandb_run_id is None
        tracker.log(1, {{"reward/score_mean": 0.5}})
        tracker.log_samples(1, {{"prompt": ["1+1="], "response": ["2"]}})
        tracker.log(2, {{"reward/score_mean": 0.7}})
        tracker.finish("FINISHED", None)
        print(tracker.run_id)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="online", HOME=str(tmp_path), NETRC=str(tmp_path / "no_netrc"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: W&B")]
    assert len(warnings) == 1 and "did not start a run" in warnings[0] and "API key" in warnings[0], done.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    import mlflow
    client = mlflow.MlflowClient(uri)
    run = client.get_run(done.stdout.split()[-1])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/score_mean")) == [1, 2]
