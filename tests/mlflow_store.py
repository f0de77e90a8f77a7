"""MLflow SQLite stores for the runs the tests start, copied from one empty store made once per
session: a fresh store runs MLflow's schema migrations, seconds of CPU for every run that would
otherwise create its own."""
import atexit
import shutil
import tempfile
from pathlib import Path

_template: list[Path] = []


def sqlite_uri(directory, name: str = "mlflow.db") -> str:
    """The URI of directory/name, which starts as a copy of the empty store unless it exists."""
    db = Path(directory) / name
    if not db.exists():
        shutil.copyfile(_empty_store(), db)
    return f"sqlite:///{db}"


def _empty_store() -> Path:
    if not _template:
        from mlflow.tracking import MlflowClient
        folder = Path(tempfile.mkdtemp(prefix="mlflow_store_"))
        atexit.register(shutil.rmtree, folder, True)
        MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db").search_experiments()   # creates the tables
        _template.append(folder / "mlflow.db")
    return _template[0]
