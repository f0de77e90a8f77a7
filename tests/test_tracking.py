"""The Tracker on a real SQLite MLflow store, in process: what it draws and sends."""
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
