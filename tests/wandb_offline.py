"""Offline W&B runs for the tests that start a run with wandb=true (no network here): the
environment that keeps W&B offline, quiet and inside the test's folder, and an offline run read
back from its transaction log (run-<id>.wandb) by W&B's own reader, `wandb leet inspect --json`."""
import json
import subprocess
import sys
from pathlib import Path


def env(tmp: Path) -> dict:
    """W&B offline and silent; its staging, cache and settings folders in tmp (not the home folder)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DATA_DIR": str(tmp / "wandb_data"),
            "WANDB_CACHE_DIR": str(tmp / "wandb_cache"), "WANDB_CONFIG_DIR": str(tmp / "wandb_config")}


def runs(out: Path) -> list[Path]:
    """The offline run folders under a run's output_dir, oldest first (a resumed run adds one)."""
    return sorted((out / "wandb").glob("offline-run-*"))


def read(run_dir: Path) -> dict:
    """-> {"run": the run record (id, project, name, config), "history": {step: logged values},
    "exit_code": the code finish() gave (None if it never finished)}."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    out = {"run": None, "history": {}, "exit_code": None}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        kind = record["type"]
        if kind == "run":
            out["run"] = record["run"]
        elif kind == "history":
            item = record["history"]["item"]
            out["history"][item["_step"]] = {k: v for k, v in item.items() if not k.startswith("_")}
        elif kind == "exit":
            out["exit_code"] = record["exit"].get("exit_code", 0)   # proto3 JSON leaves a 0 out
    return out
