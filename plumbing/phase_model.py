"""The phase-time model of rollout_mode: a run's generation, training and sync times per step
(its metrics.jsonl) -> the predicted step time of each mode; --dry_run prints it for the last run
in output_dir.

A step is generation G (the rollout side's time/gen_s colocated, rollout/gen_s otherwise),
training T (everything else the trainer does: scoring, the forward passes, the update, logging)
and the weight sync S. Colocated runs them one after the other. With the rollout side on devices
of its own, as fast as the colocated generation, one_step_off and async (max_staleness >= 1)
overlap G with T: the trainer's weight send waits for the batch being generated, so each side's
cycle ends in the same sync and a step takes max(G, T) + S; async with max_staleness 0 cannot
overlap (G + T + S). Splitting the same devices instead (a share r of them generating, the rest
training) under linear scaling gives max(G / r, T / (1 - r)) + S, at best G + T + S at r = G / (G + T):
on the same devices the overlap pays only as far as the phases scale worse than linearly (decoding
is memory-bound; a long tail holds every rank of a colocated step). Read it from a colocated run:
an overlapped run's time/sync_s also holds the trainer's wait for the batch being generated.

memory_report: the same run's peak memory per phase (perf/peak_rss_gb/<phase>, perf/peak_cuda_gb/<phase>),
so a user sees which phase sets the peak before changing sizes.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


def phase_times(records: list[dict]) -> dict | None:
    """The median per-step G, T and S of a run's step records (the first step left out when there are
    others: it warms up), or None without any."""
    steps = [r for r in records if "time/step_s" in r]
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        return None

    def parts(r):
        gen = r.get("rollout/gen_s", r.get("time/gen_s", 0.0))
        own = r["time/step_s"] - r.get("time/wait_rollout_s", 0.0) - r["time/sync_s"]
        return gen, own - (0.0 if "rollout/gen_s" in r else gen), r["time/sync_s"]

    gen, train, sync = (statistics.median(x) for x in zip(*map(parts, steps)))
    return {"gen": gen, "train": train, "sync": sync}


def predict(gen: float, train: float, sync: float) -> dict:
    """Predicted seconds per step of each mode, the rollout side on devices of its own."""
    overlapped = max(gen, train) + sync
    return {"colocated": gen + train + sync, "one_step_off": overlapped, "async (max_staleness >= 1)": overlapped,
            "async (max_staleness 0)": gen + train + sync}


def report(metrics: Path) -> list[str]:
    """The lines --dry_run prints for a run's metrics.jsonl (none if it holds no step)."""
    times = phase_times([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()])
    if times is None:
        return []
    gen, train, sync = times["gen"], times["train"], times["sync"]
    steps = predict(gen, train, sync)
    lines = [f"phase times of the last run ({metrics}): generation {gen:.2f} s, training {train:.2f} s, "
             f"sync {sync:.2f} s per step (medians)"]
    lines += [f"  {mode:28s} {s:7.2f} s/step  ({steps['colocated'] / s:.2f}x colocated)" for mode, s in steps.items()]
    lines.append(f"  with the rollout side on devices of its own; on the same devices the split that balances the "
                 f"sides gives {gen / (gen + train):.0%} of them to generation, and no speed-up where both phases "
                 f"scale linearly with devices")
    return lines


MEMORY_KINDS = {"perf/peak_rss_gb": "host RSS", "perf/peak_cuda_gb": "CUDA allocated"}
PHASE_ORDER = ("setup", "wait_rollout", "gen", "score", "forward", "update", "sync", "log")


def memory_report(metrics: Path) -> list[str]:
    """The lines --dry_run prints: the peak memory of each phase in the step that set the run's peak
    (the first to reach it: memory kept for reuse holds later steps at that level), what setup held,
    and the run's peak; none if the run logged no peaks."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kinds = [k for k in MEMORY_KINDS if any(k in r for r in records)]
    if not kinds:
        return []

    def phases(r: dict, kind: str) -> dict:   # phase -> GB, the figures the step has
        return {key.split("/")[2]: v for key, v in r.items()
                if key.startswith(kind + "/") and key.count("/") == 2 and math.isfinite(v)}

    steps = [r for r in records if phases(r, kinds[0])]
    top = max(steps, key=lambda r: max([v for p, v in phases(r, kinds[0]).items() if p != "setup"], default=-math.inf))
    setup = next((r for r in steps if any(f"{k}/setup" in r for k in kinds)), {})
    table = {k: {**{p: v for p, v in phases(setup, k).items() if p == "setup"},
                 **{p: v for p, v in phases(top, k).items() if p != "setup"}} for k in kinds}
    order = sorted(set().union(*table.values()), key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER
                                                                else len(PHASE_ORDER), p))
    cell = lambda value: f"{value:>14.2f}" if value is not None else f"{'-':>14}"   # noqa: E731
    lines = [f"peak memory per phase of the last run ({metrics}), GB, in step {top['step']}, the first to reach "
             f"the run's peak:", f"  {'phase':<14}" + "".join(f"{MEMORY_KINDS[k]:>14}" for k in kinds)]
    lines += [f"  {phase:<14}" + "".join(cell(table[k].get(phase)) for k in kinds) for phase in order]
    lines.append(f"  {'whole run':<14}" + "".join(cell(max([r[k] for r in records if k in r], default=None))
                                                   for k in kinds))
    busiest = max((p for p in table[kinds[0]] if p != "setup"), key=table[kinds[0]].get, default=None)
    if busiest is not None:
        lines.append(f"  the {MEMORY_KINDS[kinds[0]]} peak is set in {busiest}")
    return lines
