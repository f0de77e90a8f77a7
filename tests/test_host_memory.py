"""host_memory: freed large tensors leave the process's resident memory, or stay for reuse (glibc, Linux)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, torch
from plumbing import host_memory
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
took = host_memory.set_malloc(float(sys.argv[1]))
keep, start = [], rss_mib()
for _ in range(3):
    big = [torch.ones(2 << 20) for _ in range(16)]   # 16 x 8 MiB
    keep.append(torch.ones(1000))                    # a small block allocated after them, still alive
    del big
print(took, rss_mib() - start)
"""


def probe(threshold_mb: float) -> tuple[bool, float]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(threshold_mb)], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    took, grown = proc.stdout.split()
    return took == "True", float(grown)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_leave_resident_memory():
    """3 x 128 MiB allocated and freed, with live small blocks above them on the heap: with the
    threshold the process ends within a few MiB of where it started (with glibc's adaptive default
    it keeps about 140 MiB here)."""
    took, grown = probe(4)
    assert took
    assert grown < 16, f"{grown:.0f} MiB still resident"


REUSE = """
import resource, sys, torch
from plumbing import host_memory
took = host_memory.set_malloc(0) if sys.argv[1] == "set" else None
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big = [torch.ones(2 << 20) for _ in range(16)]   # 16 x 8 MiB, written: 32,768 pages
    del big                                          # nothing above them: glibc's default trims them away
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, *faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_zero_keeps_freed_blocks_for_reuse():
    """The default: 128 MiB allocated, written and freed three times; the freed blocks stay in the
    process, so the second and third rounds reuse them without page faults (glibc's own default
    gives them back at each free and faults all 32,768 pages in again each round)."""
    proc = subprocess.run([sys.executable, "-c", REUSE, "set"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    took, *faults = proc.stdout.split()
    first, *later = map(int, faults)
    assert took == "True"
    assert first > 30_000 and sum(later) < first, faults   # mostly reused (0-14k seen); each round fresh: 2x first


PHASES = """
import json, torch
from plumbing import host_memory
peaks, times = host_memory.PEAKS, {}
def hold(mib):   # written, so resident; freed at return (its own mapping: it leaves the process)
    block = torch.ones(mib << 18)
    return float(block[-1])
with peaks.phase("outer", times):
    with peaks.phase("big", times):
        hold(256)
    with peaks.phase("small", times):
        hold(16)
with peaks.phase("small", times):   # the same phase again: the larger of the two
    hold(64)
print(json.dumps({**peaks.of_step(times), "peak_memory_gib": host_memory.peak_memory_gb(),
                  "now": host_memory._host_peak() / 1e9}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's resettable high-water mark")
def test_each_phase_gets_its_own_peak_and_the_run_keeps_the_largest():
    """A 256 MiB block in one phase, 16 and 64 MiB ones in another: each phase reports its own peak
    (the mark is reset between them), a phase around both reports the larger, and the run's peak
    (perf/peak_rss_gb, peak_memory_gb) keeps the 256 MiB one that getrusage no longer sees."""
    import json
    proc = subprocess.run([sys.executable, "-c", PHASES], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    big, small, outer = (got[f"perf/peak_rss_gb/{p}"] for p in ("big", "small", "outer"))
    setup = got["perf/peak_rss_gb/setup"]   # what the process held before its first phase
    assert big - setup > 0.25, got                   # 256 MiB = 0.268 GB over the start
    assert 0.05 < small - setup < 0.1, got           # the 64 MiB phase, not the 256 MiB one before it
    assert outer == big, got
    assert got["perf/peak_rss_gb"] >= big and got["peak_memory_gib"] * 2**30 / 1e9 >= big, got
    # why the run keeps its own: the reset hid the peak from the mark (which getrusage reads too; its
    # ru_maxrss also keeps the launching process's mark from the exec, here a pytest worker's)
    assert got["now"] < big - 0.15, got


def test_bench_takes_the_larger_of_wait4_and_the_logged_run_peak():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = [{"perf/peak_rss_gb": 1.4, "perf/peak_rss_gb/gen": 1.0, "perf/peak_rss_gb/update": 1.4},
            {"perf/peak_rss_gb": 1.5, "perf/peak_rss_gb/gen": 1.1, "perf/peak_rss_gb/update": float("nan")}]
    assert bench.run_peak_rss(0.9, rows) == (1.5, {"gen": 1.1, "update": 1.4})
    assert bench.run_peak_rss(1.6, rows)[0] == 1.6   # the tail after the last reset set the peak


RANKS = """
import json, sys, torch
sys.path.insert(0, {root!r})
from config import Config
from distribution.prepare import make_accelerator
from distribution.reductions import reduce_metrics
from plumbing import host_memory
acc, _ = make_accelerator(Config())   # as train_ppo.py makes it
times = {{}}
with host_memory.PEAKS.phase("gen", times):
    if acc.process_index == 0:   # only rank 0 holds 256 MiB more in this phase
        block = torch.ones(256 << 18)
        del block
with host_memory.PEAKS.phase("update", times):
    pass
mine = host_memory.PEAKS.of_step(times)
reduced = reduce_metrics(acc, mine, how="max")
print("RANK " + json.dumps({{"rank": acc.process_index, "mine": mine, "reduced": reduced}}), flush=True)
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's resettable high-water mark")
def test_every_rank_logs_the_largest_peak_of_any_rank(tmp_path):
    """2 processes launched as the trainer is (ZeRO-3 config, gloo): rank 0 alone holds 256 MiB
    more in one phase; after the step's reduction both ranks log rank 0's peak for it, the same keys."""
    import json
    import re

    import forkserver
    from ports import free_port
    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(root=str(ROOT)))
    proc = forkserver.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(ROOT / "accelerate_configs" / "zero3.yaml"), f"--main_process_port={free_port()}",
                           str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    found = [json.loads(m) for m in re.findall(r"RANK (\{.*?\}\})\s*(?=RANK|$)", proc.stdout, re.S)]
    assert sorted(r["rank"] for r in found) == [0, 1], proc.stdout + proc.stderr[-3000:]
    ranks = {r["rank"]: r for r in found}
    gen = "perf/peak_rss_gb/gen"
    assert ranks[0]["mine"][gen] - ranks[1]["mine"][gen] > 0.2, ranks   # rank 0's phase held the block
    assert ranks[0]["reduced"] == ranks[1]["reduced"], ranks
    assert ranks[1]["reduced"][gen] == ranks[0]["mine"][gen]
    assert set(ranks[0]["reduced"]) >= {gen, "perf/peak_rss_gb/update", "perf/peak_rss_gb", "perf/peak_rss_gb/setup"}


RELEASE = """
import gc, json, sys, weakref
import torch
sys.path.insert(0, sys.argv[1])
import train_ppo
import config

run = train_ppo.setup(config.load_config(sys.argv[3:]))
for model, optim, _ in run.trained.values():   # one real AdamW step each: the optimizers now hold their states
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
del model, p   # the driver's own references
states = {role: len(optim.state) for role, (_, optim, _) in run.trained.items()}
gone = {name: weakref.ref(getattr(run, name)) for name in ("critic", "ref")}
optims = [optim for _, optim, _ in run.trained.values()]
train_ppo.release_training_state(run)
gc.collect()
final = train_ppo.save_final(run.accelerator, run.actor, run.tokenizer, run.tracker.out_dir, run.ds)
run.tracker.finish("FINISHED", None)
run.engine.shutdown()
print("RELEASED " + json.dumps({"states_before": states, "states_after": [len(o.state) for o in optims],
                                "alive": [name for name, ref in gone.items() if ref() is not None],
                                "trained": sorted(run.trained), "final": (final / "config.json").is_file()}))
"""


def demo_probe(script: str, marker: str, tmp_path) -> dict:
    """Runs a probe script on one step of the demo's setup (the hf engine) -> the JSON it printed after marker."""
    import json
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT), "unused", f"--output_dir={tmp_path / 'run'}",
                           "--train_batch_size=8", "--ppo_mini_batch_size=8", "--val_before_train=false",
                           "--test_freq=-1", "--total_training_steps=1", "--rollout_engine=hf",
                           f"--mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split(marker + " ", 1)[1])


def test_the_run_frees_its_training_state_before_the_final_save(tmp_path):
    """After the last step the optimizers' states, the critic and the reference are let go (nothing
    else holds them: they are collected), so the final save and MLflow's model logging reuse that
    memory; the actor is still there to be saved."""
    got = demo_probe(RELEASE, "RELEASED", tmp_path)
    assert got["states_before"]["actor"] > 0 and got["states_before"]["critic"] > 0, got
    assert got["states_after"] == [0, 0], got
    assert got["alive"] == [], got
    assert got["trained"] == ["actor"] and got["final"], got


FILE_PAGES = """
import json, sys, torch
from transformers import AutoModelForCausalLM, Qwen2Config
from plumbing import host_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
path, out = sys.argv[1], {}
cfg = Qwen2Config(vocab_size=16384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
ids = torch.arange(3, 40)[None]
def logits(model):
    with torch.no_grad():
        return model(input_ids=ids).logits
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
out["weights"] = sum(p.numel() * 4 for p in model.parameters())
before = logits(model)
resident = rss()
out["dropped"] = host_memory.release_file_pages(model)
out["rss_fell"] = resident - rss()
out["dropped_again"] = host_memory.release_file_pages(model)    # nothing resident left to drop
out["same_after"] = torch.equal(logits(model), before)            # mapped again from the page cache
with torch.no_grad():
    model.model.layers[0].mlp.up_proj.weight.add_(1.0)          # written: its page is the process's own now
written = logits(model)
out["dropped_written"] = host_memory.release_file_pages(model)
out["write_kept"] = torch.equal(logits(model), written) and not torch.equal(written, before)
converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)   # a copy in another dtype
logits(converted)
out["dropped_converted"] = host_memory.release_file_pages(converted)
out["nothing"] = host_memory.release_file_pages(None)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="Linux's /proc/self/maps and pagemap")
def test_frozen_weights_leave_resident_memory_and_come_back_the_same(tmp_path):
    """A model loaded from safetensors (mapped, 8.9 MB of weights) after a forward pass: its pages
    leave the process's resident set (the bytes reported, VmRSS falls as much) and the next pass
    gives the same logits bit for bit. A mapping with a written page is left alone (dropping it would
    lose the write), and so are weights that are the process's own copy (loaded in another dtype)."""
    import json
    proc = subprocess.run([sys.executable, "-c", FILE_PAGES, str(tmp_path / "model")], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["dropped"] >= 0.95 * got["weights"], got          # the whole file is mapped; all of it was read
    assert got["rss_fell"] >= 0.9 * got["dropped"], got
    assert got["same_after"], got
    assert got["dropped_again"] == 0, got
    assert got["dropped_written"] == 0 and got["write_kept"], got
    assert got["dropped_converted"] == 0 and got["nothing"] == 0, got


CODE_PAGES = """
import ctypes, json, mmap, os, sys, torch
from plumbing import host_memory
folder, page = sys.argv[1], os.sysconf("SC_PAGE_SIZE")
libc = ctypes.CDLL("libc.so.6")
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def mapping(path):   # (start, end, permissions) of the file's mapping, from /proc/self/maps
    for line in open("/proc/self/maps"):
        f = line.split(maxsplit=5)
        if len(f) == 6 and f[5].strip() == path:
            return (*(int(x, 16) for x in f[0].split("-")), f[1])
def rss_file():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssFile"))
maps = {}
for name in ("clean", "written"):
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * (64 * page // 256))
    fd = os.open(path, os.O_RDONLY)
    writable = name == "written"
    m = mmap.mmap(fd, 64 * page, flags=mmap.MAP_PRIVATE,
                  prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    if writable:
        m[page + 3] = 7                                     # one page the process's own (copied on write)
    sum(m[i * page] for i in range(64))                     # every page read: resident
    start, end, _ = mapping(path)
    if writable:
        assert libc.mprotect(start, end - start, mmap.PROT_READ) == 0   # read-only now, as RELRO is
    maps[name] = (m, path, start, end)
x = torch.randn(64, 64)
before_mm = x @ x
out = {"perms": {k: mapping(v[1])[2] for k, v in maps.items()}}
out["clean_before"] = host_memory._file_pages(*maps["clean"][2:])
rss = rss_file()
out["dropped"] = host_memory.release_code_pages()
out["rss_fell"] = rss - rss_file()
out["clean_after"] = host_memory._file_pages(*maps["clean"][2:])
out["written_kept"] = maps["written"][0][page + 3] == 7 and maps["written"][0][page + 4] == 4
out["clean_same"] = bytes(maps["clean"][0][:]) == bytes(range(256)) * (64 * page // 256)
out["torch_same"] = bool(torch.equal(x @ x, before_mm))
out["dropped_again"] = host_memory.release_code_pages()
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="Linux's /proc/self/maps and pagemap")
def test_library_pages_leave_resident_memory_and_a_written_mapping_stays(tmp_path):
    """After importing torch: the read-only file mappings' pages (the libraries' code above all, and a
    256 KiB file mapped read-only and read through) leave the resident set, RssFile falls by about as
    much as reported, and what is read again comes back the same (the file's bytes, a matmul's bits). A
    mapping made read-only after one of its pages was written (as a library's relocated data is)
    keeps that page: dropping it would lose the write."""
    import json
    proc = subprocess.run([sys.executable, "-c", CODE_PAGES, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["perms"] == {"clean": "r--p", "written": "r--p"}, got
    assert got["clean_before"] == 64 * os.sysconf("SC_PAGE_SIZE") and got["clean_after"] == 0, got
    assert got["dropped"] > 10 * 2**20, got                       # torch's libraries: tens of MB
    assert got["rss_fell"] >= 0.8 * got["dropped"], got          # less what the call itself reads again
    assert got["written_kept"] and got["clean_same"] and got["torch_same"], got
    assert got["dropped_again"] < 0.5 * got["dropped"], got      # only what was read since


PER_LAYER = """
import json, os, sys, torch
from transformers import AutoModelForCausalLM, Qwen2Config
from plumbing import host_memory
from forward.last_layer import decoder_layers
path, out = sys.argv[1], {}
cfg = Qwen2Config(vocab_size=16384, hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
ids = torch.arange(3, 40)[None]
page = os.sysconf("SC_PAGE_SIZE")
def resident(module):   # the module's weights' whole pages resident as the file's own
    total = 0
    for p in module.parameters():
        st = p.untyped_storage()
        start, end = -(-st.data_ptr() // page) * page, (st.data_ptr() + st.nbytes()) // page * page
        total += host_memory._file_pages(start, end) or 0 if end > start else 0
    return total
layers = decoder_layers(model)
for per_layer in (False, True):
    host_memory.release_file_pages(model)
    seen = []
    with host_memory.frozen_pass(model) if per_layer else torch.no_grad():   # the hook goes on after frozen_pass's
        hook = layers[-1].register_forward_hook(lambda m, a, o: seen.append([resident(x) for x in layers[:-1]]))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        hook.remove()
    out["per_layer" if per_layer else "whole"] = {"earlier_layers": seen[0], "after": resident(model), "logits": logits.tolist()}
out["layer_bytes"] = sum(p.numel() * 4 for p in layers[0].parameters())
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="Linux's /proc/self/maps and pagemap")
def test_a_frozen_pass_holds_one_layers_weights_at_a_time(tmp_path):
    """frozen_pass: when the last decoder layer has run, the earlier layers' weights are no longer
    resident (they were, without it), the whole model's are not after the pass, and the logits are
    the same bit for bit."""
    import json
    proc = subprocess.run([sys.executable, "-c", PER_LAYER, str(tmp_path / "model")], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    whole, per_layer = got["whole"], got["per_layer"]
    assert all(b >= 0.9 * got["layer_bytes"] for b in whole["earlier_layers"]), got["whole"]["earlier_layers"]
    assert all(b == 0 for b in per_layer["earlier_layers"]), per_layer["earlier_layers"]
    assert per_layer["after"] == 0 and whole["after"] > 0
    assert per_layer["logits"] == whole["logits"]


RESIDENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import train_ppo
import config
from plumbing import host_memory

def resident(model):   # bytes of the file mappings that hold the model's weights, resident as the file's pages
    pointers = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(host_memory._file_pages(start, end) or 0 for start, end in host_memory._private_file_mappings()
               if any(start <= p < end for p in pointers))

run = train_ppo.setup(config.load_config(sys.argv[3:]))
seen = {"weights": sum(p.numel() * p.element_size() for p in run.ref.parameters()), "setup": resident(run.ref)}
update_critic = train_ppo.update_critic
def update(*args, **kwargs):   # the update, the phase that sets the run's peak
    seen["update"] = resident(run.ref)
    return update_critic(*args, **kwargs)
train_ppo.update_critic = update
train_ppo.train_step(run, 1)
run.tracker.finish("FINISHED", None)
run.engine.shutdown()
print("RESIDENT " + json.dumps(seen))
"""


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="Linux's /proc/self/maps and pagemap")
def test_the_reference_is_not_resident_during_the_update(tmp_path):
    """The demo's reference (the policy's file, mapped at load) is resident after setup and out of the
    resident set when the update starts: its pass is over, and the update does not read it."""
    got = demo_probe(RESIDENT, "RESIDENT", tmp_path)
    assert got["setup"] >= 0.95 * got["weights"], got
    assert got["update"] == 0, got
