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

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=16",
        "--total_training_steps=8", "--test_freq=-1"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp, port):
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp}/server.db",
                             "--artifacts-destination", str(tmp / "artifacts")],
                            cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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


def lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(condition, proc, seconds=300):
    deadline = time.time() + seconds
    while not condition() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)


def test_training_survives_a_tracking_outage_and_mlflow_catches_up(tmp_path):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    out = tmp_path / "out"
    metrics = out / "metrics.jsonl"
    train = subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={out}", *ARGS],
                             cwd=tmp_path, env=dict(os.environ, MLFLOW_TRACKING_URI=uri), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: lines(metrics) >= 2, train)        # validation + the first step went through
        stop_server(server)
        wait_for(lambda: lines(metrics) >= 9, train)        # every step ran with the server down
        assert lines(metrics) == 9, "training stalled or died while the tracking server was down"
        server = start_server(tmp_path, port)
        stdout, stderr = train.communicate(timeout=300)
        assert train.returncode == 0, stderr[-3000:]
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(9))

        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri=uri)
        run = client.search_runs([client.get_experiment_by_name("ppo").experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "reward/score_mean")
        assert sorted({m.step for m in history}) == list(range(1, 9))   # the outage's steps caught up
    finally:
        if train.poll() is None:
            train.kill()
        if server.poll() is None:
            stop_server(server)
