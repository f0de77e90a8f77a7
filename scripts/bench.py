"""W1, W3 and W5 (docs/benchmarks.md): train_ppo.py against TRL 1.12.0's PPOTrainer, same workload, one run.

    python scripts/bench.py                          # W1 and W3, 3 repeats each (about 20 min on an idle 2-core machine)
    python scripts/bench.py --workloads w1 --repeats 1 --iterations 3     # a quick check
    python scripts/bench.py --workloads w5 --repeats 1     # W5 at 512, 1,024 and 2,048 response tokens (about 40 min)

W5 (configs/w5.yaml, scripts/make_w5.py) is W3's model and vocabulary with responses that end at EOS after
very different lengths (token-budget micro-batches, packing and gradient checkpointing on ours' side; TRL
pads). Each length of --w5_lengths is its own workload, w5_<length>, run with --max_response_length=<length>
(the peer reads it from ours' config.yaml like every other value); the report adds each side's mean
response length (they sample differently, so the two means differ by chance: compare times with them in
view) and a table of how time and peak memory grow with the length. Repeat k runs both sides with seed
k - 1: each repeat draws other lengths, so the pooled figures average over draws where one seed would
give one side the same lucky (or unlucky) lengths every time (W1 and W3 too: their lengths are fixed,
their times do not depend on the seed; the pooled reward and KL then mix seeds, on both sides alike).

What it does, in order:
  1. builds the assets if missing: scripts/make_w1.py -> runs/w1_assets, scripts/make_w3.py -> runs/w3_assets,
     scripts/make_w5.py -> runs/w5_assets (from runs/w3_assets);
  2. makes the peer's virtual environment if missing (--peer_venv, default runs/trl_peer_venv):
     `python -m venv --system-site-packages`, then `pip install trl==1.12.0 --no-deps` into it (its other
     requirements, accelerate, transformers, jinja2 and packaging, come from this Python's packages;
     `datasets`, which the project does not use, is installed into the venv if missing). The project's
     own environment and requirements are not touched;
  3. measures the import baseline of each side: the peak RSS of a process that only imports what that
     side's run imports (train_ppo with the stack it imports lazily: transformers, accelerate, mlflow,
     pandas, ...; trl.experimental.ppo with datasets, transformers, ... in the venv), lowest of 2 tries;
  4. per workload, alternates `--repeats` times (repeat k with seed k - 1 on both sides): ours
     (train_ppo.py --config configs/<w>.yaml), then the peer (scripts/bench_trl_peer.py, reading the
     config.yaml ours wrote, so both run the same values), each as its own process, one at a time; the
     peak RSS of each is its rusage from wait4, for ours the larger of that and the run's perf/peak_rss_gb
     (train_ppo.py resets the process's high-water mark at each phase to measure the phase's peak, so
     wait4 sees only the peak since the last reset; the run folds each mark into perf/peak_rss_gb first);
  5. prints per side: the median iteration time over iterations 2..N (pooled over repeats; with several
     repeats also each repeat's own, the machine's drift between them shows), the median of each phase,
     the peak RSS (median over repeats) and the import baseline, then ours/peer ratios, and ours' peak
     RSS per phase (perf/peak_rss_gb/<phase>, the largest over a run's steps, median over repeats); also the mean
     reward and the last iteration's per-token KL of each side, and a warning when other processes used
     the CPU during a run (measured from /proc/stat: such timings are meaningless); for W5 also the mean
     response length of each side and the growth table;
  6. ours logs perf/mfu against this machine's fp32 matmul peak, measured first (the fastest of 80
     matmuls of transformer shapes on all cores; a CPU has no datasheet figure that PyTorch reaches),
     passed as --peak_tflops; the peak is measured again after each workload, and the medians are
     printed against the highest of those measurements (a shared machine's busy moment measures
     the peak low: 0.157 against 0.185-0.188 TFLOPS on one machine, which flattered perf/mfu by a fifth).
Everything goes under --out (default runs/bench): per run its log, metrics.jsonl / iterations.jsonl,
and results.json with every number printed.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_TRL = "1.12.0"
WORKLOADS = {   # name: (config, asset builder, asset dir, default iterations)
    "w1": ("configs/w1.yaml", "scripts/make_w1.py", "runs/w1_assets", 10),
    "w3": ("configs/w3.yaml", "scripts/make_w3.py", "runs/w3_assets", 6),
    "w5": ("configs/w5.yaml", "scripts/make_w5.py", "runs/w5_assets", 5),   # one run per --w5_lengths entry
}
MFU_KEYS = ("perf/mfu", "perf/mfu/actor", "perf/mfu/critic", "perf/mfu/update", "perf/mfu/gen", "perf/mfu/forward")
OURS_PHASES = ("gen", "score", "forward", "update", "sync", "log")
PEER_PHASES = ("gen", "score", "forward", "update", "other")
# What each side's process imports in a single-process run (train_ppo.py imports most of its stack lazily).
_MODELS = ("from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer; "
           "import transformers.models.qwen2.modeling_qwen2; ")
OURS_IMPORTS = ("import train_ppo; from plumbing import lean_imports; lean_imports.skip_unused(); "   # as train_ppo's setup() does
                "import yaml, pandas, mlflow, tqdm, accelerate; " + _MODELS + "import rollout.hf")
PEER_IMPORTS = ("import torch, yaml, pandas, datasets, accelerate; " + _MODELS +
                "from trl.experimental.ppo import PPOConfig, PPOTrainer")
BUSY_WARN_CORES = 0.2   # other processes' CPU use during a run (cores, averaged) above which numbers are suspect


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_measured(cmd: list[str], log_path: Path, env: dict | None = None, check: bool = True) -> dict:
    """Run cmd in the repository root, output to log_path; its wall time and peak RSS (wait4's rusage)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    busy_before = busy_cpu_s()
    start = time.perf_counter()
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    own_cpu = usage.ru_utime + usage.ru_stime
    result = {"rc": proc.returncode, "wall_s": wall, "cpu_s": own_cpu,
              "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,    # Linux: ru_maxrss in KiB
              # CPU the rest of the machine used meanwhile, in cores: other work skews the timings
              "other_busy_cores": max(0.0, busy_cpu_s() - busy_before - own_cpu) / wall if wall else 0.0}
    if check and proc.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"bench: {' '.join(cmd[:3])} ... failed (exit {proc.returncode}), log {log_path}:\n{tail}")
    return result


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat), all cores."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")   # user..steal, no guest (counted in user)


def ensure_assets(names: list[str]) -> None:
    for name in names:
        _, builder, assets, _ = WORKLOADS[name]
        needed = [ROOT / assets / p for p in ("policy/config.json", "reward/config.json", "prompts.parquet")]
        if all(p.exists() for p in needed):
            log(f"{name}: assets in {assets}")
            continue
        log(f"{name}: building assets with {builder}")
        subprocess.run([sys.executable, builder, "--out", assets], cwd=ROOT, check=True)


def ensure_peer_venv(venv: Path) -> Path:
    """A venv on top of this Python's packages with trl==1.12.0 installed into it; its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"peer: creating {venv} (--system-site-packages)")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    probe = [str(python), "-c", "import trl; print(trl.__version__)"]
    have = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
    if have != PEER_TRL:
        log(f"peer: installing trl=={PEER_TRL} into {venv} (found {have or 'none'})")
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        f"trl=={PEER_TRL}", "--no-deps"], check=True)
    # the peer needs `datasets`, which the project does not: into the venv only, with its own deps
    if subprocess.run([str(python), "-c", "import datasets"], capture_output=True).returncode != 0:
        log(f"peer: installing datasets into {venv} (TRL's PPO trainer imports it)")
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "datasets"],
                       check=True)
    check = subprocess.run([str(python), "-c", PEER_IMPORTS + "; import trl; print(trl.__version__)"],
                           capture_output=True, text=True, cwd=ROOT)
    if check.returncode != 0 or check.stdout.strip().splitlines()[-1:] != [PEER_TRL]:
        raise SystemExit(f"bench: the peer venv {venv} cannot import TRL {PEER_TRL}'s PPO trainer:\n"
                         f"{check.stderr[-3000:]}")
    log(f"peer: trl {PEER_TRL} ready in {venv}")
    return python


def import_baseline(python: str, code: str, path: Path, repeats: int = 2) -> float:
    """Peak RSS (GB) of a process that only imports; the lowest of a few tries (imports do not vary)."""
    return min(run_measured([python, "-c", code], path.with_name(f"{path.name}_{i}.log"))["peak_rss_gb"]
               for i in range(repeats))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


MEASURE_PEAK = """
import time, torch
best = 0.0
for m, k, n in [(1024, 1024, 1024), (2048, 1024, 1024), (1280, 256, 512), (1280, 512, 256)]:
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3): a @ b
    for _ in range(20):
        start = time.perf_counter(); a @ b; best = max(best, 2 * m * k * n / (time.perf_counter() - start))
print(best / 1e12)
"""


def measured_peak_tflops() -> float:
    """This machine's fp32 matmul throughput (TFLOPS), the yardstick for ours' perf/mfu."""
    proc = subprocess.run([sys.executable, "-c", MEASURE_PEAK], capture_output=True, text=True, check=True)
    return float(proc.stdout.split()[-1])


def run_ours(name: str, workload: str, overrides: list[str], rep: int, iterations: int, out: Path, env: dict,
             peak_tflops: float) -> dict:
    """name: the run's label (w5_1024); workload: its entry in WORKLOADS (w5); overrides: extra --key=value.
    Repeat rep runs with seed rep - 1, and the peer with it (it reads ours' config.yaml)."""
    config = WORKLOADS[workload][0]
    run_dir = out / name / f"ours_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "train_ppo.py", "--config", config, *overrides, f"--output_dir={run_dir}",
           f"--total_training_steps={iterations}", "--resume=never", "--save_freq=-1",
           f"--mlflow_tracking_uri=sqlite:///{out / 'mlflow.db'}", "--mlflow_experiment=bench",
           f"--run_name={name}_ours_{rep}", f"--peak_tflops={peak_tflops}", f"--seed={rep - 1}"]
    result = run_measured(cmd, out / name / f"ours_{rep}.log", env)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time/step_s" in r]
    result["peak_rss_gb"], result["phase_peak_rss_gb"] = run_peak_rss(result["peak_rss_gb"], rows)
    result["iterations"] = [{k: v for k, v in r.items() if k.startswith(("time/", "perf/mfu")) or k in
                             ("step", "reward/score_mean", "kl/mean", "rollout/response_len_mean",
                              "rollout/truncated_frac")} for r in rows]
    result["config"] = str(run_dir / "config.yaml")
    return result


def run_peak_rss(wait4_gb: float, rows: list[dict]) -> tuple[float, dict]:
    """Ours' peak RSS: the larger of wait4's (the peak since train_ppo.py's last reset of the high-water
    mark, at its last phase) and the largest perf/peak_rss_gb it logged (every mark before that reset),
    and each phase's peak (perf/peak_rss_gb/<phase>, the largest over the steps)."""
    phases: dict = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("perf/peak_rss_gb/") and value == value:   # not NaN
                phase = key.rsplit("/", 1)[1]
                phases[phase] = max(phases.get(phase, value), value)
    return max([wait4_gb] + [r["perf/peak_rss_gb"] for r in rows if "perf/peak_rss_gb" in r]), phases


def run_peer(name: str, rep: int, iterations: int, out: Path, python: str, config: str, env: dict) -> dict:
    run_dir = out / name / f"peer_{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [python, "scripts/bench_trl_peer.py", "--config", config, "--iterations", str(iterations),
           "--out", str(run_dir)]
    result = run_measured(cmd, out / name / f"peer_{rep}.log", env)
    result["iterations"] = read_jsonl(run_dir / "iterations.jsonl")
    result["checks"] = json.loads((run_dir / "summary.json").read_text())
    return result


def summarize(runs: list[dict], phases: tuple, baseline: float) -> dict:
    """Iterations 2..N of every repeat pooled: median step time and per-phase medians; peak RSS median."""
    later = [it for r in runs for it in r["iterations"][1:]]
    summary = {"step_s": median([it["time/step_s"] for it in later]),
               "first_step_s": median([r["iterations"][0]["time/step_s"] for r in runs if r["iterations"]]),
               "phases": {p: median([it.get(f"time/{p}_s", 0.0) for it in later]) for p in phases},
               "peak_rss_gb": median([r["peak_rss_gb"] for r in runs]),
               "import_rss_gb": baseline, "wall_s": median([r["wall_s"] for r in runs]),
               "n_iterations": len(later), "other_busy_cores": max(r["other_busy_cores"] for r in runs),
               # each repeat's own median: the machine's drift between repeats shows beside the pooled one
               "repeat_step_s": [median([it["time/step_s"] for it in r["iterations"][1:]]) for r in runs],
               "repeat_response_len": [statistics.fmean([it.get("rollout/response_len_mean", float("nan"))
                                                         for it in r["iterations"][1:]] or [float("nan")]) for r in runs]}
    summary["score_mean"] = statistics.fmean([it.get("reward/score_mean", float("nan")) for r in runs
                                              for it in r["iterations"]])
    summary["kl_last"] = median([r["iterations"][-1].get("kl/mean", float("nan")) for r in runs if r["iterations"]])
    summary["peak_above_import_gb"] = summary["peak_rss_gb"] - baseline
    per_run = [r.get("phase_peak_rss_gb", {}) for r in runs]   # ours only
    summary["phase_peak_rss_gb"] = {p: median([peaks[p] for peaks in per_run if p in peaks])
                                    for p in dict.fromkeys(p for peaks in per_run for p in peaks)}
    summary["phase_sum_s"] = median([sum(it.get(f"time/{p}_s", 0.0) for p in phases) for it in later])
    summary["mfu"] = {k: median([it[k] for it in later if k in it]) for k in MFU_KEYS if any(k in it for it in later)}
    # tokens per response, mean over the timed iterations (2..N) and over all of them
    summary["response_len_mean"] = statistics.fmean([it.get("rollout/response_len_mean", float("nan"))
                                                     for it in later]) if later else float("nan")
    summary["response_len_mean_all"] = statistics.fmean([it.get("rollout/response_len_mean", float("nan"))
                                                         for r in runs for it in r["iterations"]])
    return summary


def report(name: str, ours: dict, peer: dict, fixed_length: bool = True, mfu_scale: float = 1.0) -> None:
    def row(label, a, b, unit, fmt="{:.3f}"):
        a_text = "-" if a is None else fmt.format(a)
        b_text = "-" if b is None else fmt.format(b)
        ratio = f"{a / b:7.2f}x" if a is not None and b else ""
        print(f"  {label:<30} {a_text:>9} {b_text:>9} {unit:<3} {ratio:>8}")

    print(f"\n{name.upper()}: medians over iterations 2..N, pooled over repeats ({ours['n_iterations']} iterations "
          f"ours, {peer['n_iterations']} TRL)")
    print(f"  {'':<30} {'ours':>9} {'TRL 1.12':>9} {'':<3} {'ours/TRL':>8}")
    row("iteration time", ours["step_s"], peer["step_s"], "s")
    if len(ours["repeat_step_s"]) > 1:   # repeat k: ours' k-th run and the peer's run after it, seed k - 1
        for k, (a, b) in enumerate(zip(ours["repeat_step_s"], peer["repeat_step_s"]), 1):
            row(f"  repeat {k} (seed {k - 1})", a, b, "s")
            if not fixed_length:
                row("    mean response", ours["repeat_response_len"][k - 1], peer["repeat_response_len"][k - 1],
                    "tok", "{:.0f}")
    for phase in ("gen", "score", "forward", "update"):
        row(f"  {phase}", ours["phases"][phase], peer["phases"][phase], "s")
    row("  sync", ours["phases"]["sync"], None, "s")
    row("  log", ours["phases"]["log"], None, "s")
    row("  other (TRL: data, GAE, gc)", None, peer["phases"]["other"], "s")
    print(f"  {'  phases / iteration (ours)':<30} {ours['phase_sum_s'] / ours['step_s']:>9.1%}")
    row("first iteration", ours["first_step_s"], peer["first_step_s"], "s")
    row("peak RSS (median of runs)", ours["peak_rss_gb"], peer["peak_rss_gb"], "GB")
    row("import baseline RSS", ours["import_rss_gb"], peer["import_rss_gb"], "GB")
    row("peak RSS above imports", ours["peak_above_import_gb"], peer["peak_above_import_gb"], "GB")
    for phase, gb in ours["phase_peak_rss_gb"].items():   # which phase sets ours' peak
        row(f"  peak RSS in {phase} (ours)", gb, None, "GB")
    row("process wall time (median)", ours["wall_s"], peer["wall_s"], "s", "{:.1f}")
    print(f"  {'reward, mean of iterations':<30} {ours['score_mean']:>9.4f} {peer['score_mean']:>9.4f}")
    print(f"  {'KL per token, last iteration':<30} {ours['kl_last']:>9.4f} {peer['kl_last']:>9.4f}")
    if not fixed_length:
        row("mean response length", ours["response_len_mean"], peer["response_len_mean"], "tok", "{:.0f}")
        row("  ... over all iterations", ours["response_len_mean_all"], peer["response_len_mean_all"], "tok", "{:.0f}")
    for key, value in ours["mfu"].items():   # logged against the first peak, printed against the highest
        print(f"  {key + ' (ours)':<30} {value * mfu_scale:>9.1%}   of the measured matmul peak")
    busy = max(ours["other_busy_cores"], peer["other_busy_cores"])
    if busy > BUSY_WARN_CORES:
        print(f"  WARNING: other processes used up to {busy:.2f} cores during these runs: the timings are skewed")


def report_growth(labels: list[str], workloads: dict) -> None:
    """W5: iteration time and peak RSS per response length, each also as a multiple of the first length's."""
    base = workloads[labels[0]]

    def cell(side: str, key: str, w: dict) -> str:
        value = w[side][key]
        return f"{value:6.2f} ({value / base[side][key]:4.2f}x)"

    print("\nW5: growth with the response length (medians; (x) = multiple of the first row)")
    print(f"  {'length':>6}  {'ours s/it':>15} {'TRL s/it':>15} {'ratio':>5}  {'ours GB':>15} {'TRL GB':>15} "
          f"{'ratio':>5}  {'tokens/response':>15}")
    for label in labels:
        w = workloads[label]
        o, p = w["ours"], w["peer"]
        print(f"  {w['response_length']:>6}  {cell('ours', 'step_s', w):>15} {cell('peer', 'step_s', w):>15} "
              f"{o['step_s'] / p['step_s']:>5.2f}  {cell('ours', 'peak_rss_gb', w):>15} "
              f"{cell('peer', 'peak_rss_gb', w):>15} {o['peak_rss_gb'] / p['peak_rss_gb']:>5.2f}  "
              f"{o['response_len_mean']:>6.0f} / {p['response_len_mean']:<6.0f}")
    print("  (tokens/response: mean over the timed iterations, ours / TRL)")


def expand(names: list[str], w5_lengths: list[int]) -> list[tuple[str, str, list[str], int | None]]:
    """The runs: (label, workload, overrides, response length); w5 becomes one run per length."""
    runs = []
    for name in names:
        if name == "w5":
            runs += [(f"w5_{n}", "w5", [f"--max_response_length={n}"], n) for n in w5_lengths]
        else:
            runs.append((name, name, [], None))
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="w1,w3", help="comma-separated: w1, w3, w5")
    parser.add_argument("--w5_lengths", default="512,1024,2048",
                        help="W5: max_response_length of each run, comma-separated (each is its own workload, w5_<n>)")
    parser.add_argument("--repeats", type=int, default=3, help="ours/peer pairs per workload, alternating")
    parser.add_argument("--iterations", type=int, default=None,
                        help="PPO iterations per run (default: w1 10, w3 6, w5 5); the first is reported apart")
    parser.add_argument("--peer_venv", default="runs/trl_peer_venv", help="the TRL 1.12.0 virtual environment")
    parser.add_argument("--ours_args", default="",
                        help="more --key=value for ours' runs, space-separated (the peer reads them from ours' "
                             "config.yaml like the rest), e.g. '--rollout_bypass_mode=true': TRL takes the old "
                             "log-probs from generation's logits, which is verl's bypass mode")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            raise SystemExit(f"bench: unknown workload {n!r} (known: {', '.join(WORKLOADS)})")
    if args.iterations is not None and args.iterations < 2:
        raise SystemExit("bench: --iterations must be at least 2 (the first iteration is not counted)")
    try:
        w5_lengths = [int(n) for n in args.w5_lengths.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"bench: --w5_lengths takes comma-separated integers, got {args.w5_lengths!r}") from None
    if "w5" in names and (not w5_lengths or min(w5_lengths) < 1):
        raise SystemExit(f"bench: --w5_lengths needs positive lengths, got {args.w5_lengths!r}")
    extra = args.ours_args.split()
    bad = [a for a in extra if not a.startswith("--") or "=" not in a]
    if bad:
        raise SystemExit(f"bench: --ours_args takes --key=value items, got {' '.join(bad)!r}")
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)

    ensure_assets(names)
    peer_python = str(ensure_peer_venv((ROOT / args.peer_venv).resolve()))
    log("import baselines")
    baselines = {"ours": import_baseline(sys.executable, OURS_IMPORTS, out / "import_ours"),
                 "peer": import_baseline(peer_python, PEER_IMPORTS, out / "import_peer")}
    log(f"import baseline RSS: ours {baselines['ours']:.3f} GB, peer {baselines['peer']:.3f} GB")

    peak_tflops = measured_peak_tflops()
    log(f"fp32 matmul peak of this machine: {peak_tflops:.3f} TFLOPS (the yardstick of perf/mfu)")
    results = {"baselines": baselines, "peak_tflops": peak_tflops, "workloads": {}}
    plan = [(name, workload, overrides + extra, length)
            for name, workload, overrides, length in expand(names, w5_lengths)]
    if extra:
        log(f"ours' runs also take: {' '.join(extra)}")
    results["ours_args"] = extra
    for name, workload, overrides, length in plan:
        iterations = args.iterations or WORKLOADS[workload][3]
        runs = {"ours": [], "peer": []}
        for rep in range(1, args.repeats + 1):
            log(f"{name} repeat {rep}/{args.repeats}: ours, {iterations} iterations")
            ours = run_ours(name, workload, overrides, rep, iterations, out, env, peak_tflops)
            runs["ours"].append(ours)
            log(f"  ours: {median([i['time/step_s'] for i in ours['iterations'][1:]]):.2f} s/iteration, "
                f"peak RSS {ours['peak_rss_gb']:.2f} GB, {ours['wall_s']:.0f} s in all, "
                f"other processes {ours['other_busy_cores']:.2f} cores")
            log(f"{name} repeat {rep}/{args.repeats}: TRL {PEER_TRL}, {iterations} iterations")
            peer = run_peer(name, rep, iterations, out, peer_python, ours["config"], env)
            runs["peer"].append(peer)
            log(f"  peer: {median([i['time/step_s'] for i in peer['iterations'][1:]]):.2f} s/iteration, "
                f"peak RSS {peer['peak_rss_gb']:.2f} GB, {peer['wall_s']:.0f} s in all, "
                f"other processes {peer['other_busy_cores']:.2f} cores")
            checks = peer["checks"]
            if not checks.get("fixed_length", True):   # W5: responses end at EOS; their lengths are the check
                lengths = checks["response_lengths"]
                log(f"  response lengths, mean over all iterations: ours "
                    f"{statistics.fmean(i['rollout/response_len_mean'] for i in ours['iterations']):.0f}, TRL "
                    f"{statistics.fmean(lengths):.0f} ({min(lengths)}-{max(lengths)}, "
                    f"{sum(n >= length for n in lengths)} of {len(lengths)} at the cap)")
                if checks["pad_before_eos"]:
                    log(f"  WARNING: TRL sampled <pad> inside {checks['pad_before_eos']} responses (it reads a pad as "
                        f"the end of the response)")
            elif checks["short_responses"] or checks["eos_then_only_pad"]:
                log(f"  WARNING: TRL's responses were not fixed-length: {checks}")
        summary = {"ours": summarize(runs["ours"], OURS_PHASES, baselines["ours"]),
                   "peer": summarize(runs["peer"], PEER_PHASES, baselines["peer"])}
        results["workloads"][name] = {"iterations": iterations, "repeats": args.repeats, "response_length": length,
                                      "fixed_length": runs["peer"][0]["checks"].get("fixed_length", True),
                                      **summary, "runs": runs}
        results["peak_tflops_after"] = results.get("peak_tflops_after", []) + [measured_peak_tflops()]
        log(f"fp32 matmul peak measured again: {results['peak_tflops_after'][-1]:.3f} TFLOPS")
        (out / "results.json").write_text(json.dumps(results, indent=1))
    best = max([peak_tflops, *results.get("peak_tflops_after", [])])
    if extra:
        print(f"\nours ran with {' '.join(extra)} besides each workload's config")
    for name, _, _, _ in plan:
        w = results["workloads"][name]
        report(name, w["ours"], w["peer"], w["fixed_length"], mfu_scale=peak_tflops / best)
    w5_runs = [name for name, workload, _, _ in plan if workload == "w5"]
    if w5_runs:
        report_growth(w5_runs, results["workloads"])
    print(f"\nperf/mfu above is against {best:.3f} TFLOPS, the highest of the peak's measurements "
          f"({', '.join(f'{p:.3f}' for p in [peak_tflops, *results.get('peak_tflops_after', [])])}); the runs "
          f"logged it against the first")
    print(f"\nall numbers: {out / 'results.json'}")


if __name__ == "__main__":
    main()
