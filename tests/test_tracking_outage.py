"""The MLflow tracking server goes away mid-run: training continues, metrics.jsonl stays complete,
and MLflow catches up once the server is back. A real `mlflow server` on 127.0.0.1."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import forkserver
from mlflow_store import sqlite_uri

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow   # a real MLflow server (one for the module, restarted by the outage test)
# 4 steps: validation and step 1 reach the server, steps 2-4 (at least 3 and 4) run while it is down;
# the run waits at its end for the server as long as the test waits for the run (a loaded machine may
# take minutes to start the server again)
ARGS = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=16",
        "--total_training_steps=4", "--test_freq=-1", "--mlflow_close_timeout_s=300"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp, port):
    # without MLflow's job execution (evaluation jobs, which no test runs): it starts a job runner and
    # eight huey consumer processes beside the server, each importing MLflow, seconds of CPU each
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", sqlite_uri(tmp, "server.db"),
                             "--artifacts-destination", str(tmp / "artifacts")],
                            cwd=tmp, env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError("mlflow server did not start")


def stop_server(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


class Server:
    """One `mlflow server` on a free port for the module's tests (a start-up is seconds of CPU):
    stop() and start() again on the same port and store, as an outage does."""

    def __init__(self, tmp):
        self.tmp, self.port = tmp, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        if self.proc is None or self.proc.poll() is not None:
            self.proc = start_server(self.tmp, self.port)
        return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            stop_server(self.proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow_server")).start()
    yield srv
    srv.stop()


def lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(condition, proc, seconds=300):
    deadline = time.time() + seconds
    while not condition() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)


def test_training_survives_a_tracking_outage_and_mlflow_catches_up(tmp_path, server):
    uri = server.start().uri
    out = tmp_path / "out"
    metrics = out / "metrics.jsonl"
    train = forkserver.Popen([sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={out}", *ARGS],
                             cwd=tmp_path, env=dict(os.environ, MLFLOW_TRACKING_URI=uri), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: lines(metrics) >= 2, train)        # validation + the first step went through
        server.stop()
        wait_for(lambda: lines(metrics) >= 5, train)        # every step ran with the server down
        assert lines(metrics) == 5, "training stalled or died while the tracking server was down"
        server.start()
        stdout, stderr = train.communicate(timeout=600)
        assert train.returncode == 0, stderr[-3000:]
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(5))

        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri=uri)
        run = client.search_runs([client.get_experiment_by_name("ppo").experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "reward/score_mean")
        assert sorted({m.step for m in history}) == list(range(1, 5))   # the outage's steps caught up
    finally:
        if train.poll() is None:
            train.kill()


def test_mlflow_server_holds_params_tags_datasets_samples_curves_and_the_model(tmp_path, server):
    """Everything a run puts in MLflow, read back over HTTP from a real `mlflow server` (artifacts
    proxied by the server): the config as params, what ran as tags, every step's metrics, MLflow's
    own system metrics, the data as dataset inputs, sample generations, curves, and the final model
    as a transformers model that loads back as a text-generation pipeline."""
    import mlflow
    from mlflow.tracking import MlflowClient
    uri = server.start().uri
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PYTHONUNBUFFERED="1",
               MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1")
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={tmp_path}/out", *ARGS[:4],
                           "--total_training_steps=2", "--test_freq=1", "--mlflow_system_metrics=true",
                           "--mlflow_experiment=readback"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"open {uri} in a browser" in proc.stdout
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("readback").experiment_id])
    run_id = run.info.run_id
    assert run.data.params["total_training_steps"] == "2" and run.data.params["rollout_n"] == "2"
    tags = run.data.tags
    assert tags["world_size"] == "1" and tags["rollout_engine"] == "hf" and "version.transformers" in tags
    if (ROOT / ".git").exists():
        assert len(tags["mlflow.source.git.commit"]) == 40
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward/score_mean")) == [1, 2]
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/accuracy")) == [0, 1, 2]
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)
    inputs = {(d.dataset.name, t.value) for d in run.inputs.dataset_inputs for t in d.tags
              if t.key == "mlflow.data.context"}
    assert {("train.parquet", "training"), ("val.parquet", "validation")} <= inputs
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "curves.png", "samples"} <= artifacts
    samples = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert {"samples/step_000000.json", "samples/step_000002.json"} <= samples
    mlflow.set_tracking_uri(uri)
    pipe = mlflow.transformers.load_model(tags["model_uri"])
    text = pipe("12+34=", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("12+34=")
