"""The demo's learning curve in each rollout_mode, per step and per wall-clock second, one run each.

    python scripts/bench_async.py                                   # the demo, 300 steps, 3 modes (~12 min)
    python scripts/bench_async.py --steps 60 --test_freq 20         # a quick look
    python scripts/bench_async.py -- --config configs/w5.yaml --max_response_length=256   # any run's arguments

Runs train_ppo.py (the arguments after `--` go to every run) once per mode, one at a time:
colocated; one_step_off with one rollout process; async with max_staleness 2 (both corrected with
rollout_is=token, as stale samples require). Prints, per mode, val/accuracy (or val/score_mean) at
each validation with the wall-clock seconds the loop had taken by then (the sum of time/step_s up
to that step: setup and validation left out, alike for every mode), the median step time, and the
time each side waited: the trainer for its batch (time/wait_rollout_s) and the rollout side for work
(rollout/wait_train_s). Then the value each mode had reached at the same wall-clock seconds.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"colocated": [],
         "one_step_off": ["--rollout_mode=one_step_off", "--rollout_is=token"],
         "async (max_staleness 2)": ["--rollout_mode=async", "--max_staleness=2", "--rollout_is=token"]}


def run(out: Path, args: list[str]) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={out}", "--mlflow_log_model=false", *args]
    subprocess.run(cmd, cwd=out.parent, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out.parent / 'mlflow.db'}"})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, loop seconds by the end of that step, validation value) at each validation."""
    key = "val/accuracy" if any("val/accuracy" in r for r in records) else "val/score_mean"
    elapsed, out = 0.0, []
    for r in records:
        elapsed += r.get("time/step_s", 0.0)
        if key in r:
            out.append((r["step"], elapsed, r[key]))
    return out


def reached(points: list[tuple[int, float, float]], seconds: float) -> float | None:
    """The last validation value a run had logged by `seconds` of loop time."""
    done = [value for _, t, value in points if t <= seconds]
    return done[-1] if done else None


def median_of(records: list[dict], key: str) -> float:
    values = [r[key] for r in records[1:] if key in r]   # step 1 starts the pipeline: left out
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--test_freq", type=int, default=50)
    parser.add_argument("extra", nargs="*", help="train_ppo.py arguments for every run (after --)")
    opts = parser.parse_args()
    args = [f"--total_training_steps={opts.steps}", f"--test_freq={opts.test_freq}", *opts.extra]
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (mode, extra) in enumerate(MODES.items()):
            records = run(Path(tmp) / f"run{k}", [*args, *extra])
            curves[mode] = curve(records)
            print(f"\n{mode}: median step {median_of(records, 'time/step_s'):.2f} s, trainer waited "
                  f"{median_of(records, 'time/wait_rollout_s'):.2f} s a step, rollout side waited "
                  f"{median_of(records, 'rollout/wait_train_s'):.2f} s a step")
            print("  step  loop s  value")
            for step, seconds, value in curves[mode]:
                print(f"  {step:4d}  {seconds:6.1f}  {value:.3f}")
    ends = sorted({round(t) for points in curves.values() for _, t, _ in points if t > 0})
    print("\nvalue reached by the same loop seconds")
    print("  seconds  " + "  ".join(f"{mode:>24}" for mode in curves))
    for seconds in ends:
        row = [reached(points, seconds) for points in curves.values()]
        print(f"  {seconds:7d}  " + "  ".join(f"{'-' if v is None else f'{v:.3f}':>24}" for v in row))


if __name__ == "__main__":
    main()
