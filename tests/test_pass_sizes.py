"""How the no-grad work is cut, and that the cut changes no number: validation in rounds of
val_batch_size, the reference pass's own micro-batches (ref_log_prob_*), and the trained reward
model by token budget (reward_model_use_dynamic_bsz). Each runs the real code in process on the
demo model or a tiny Qwen2; a forward hook or a wrapped generate counts the calls."""
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from config import Config, reward_micro_batch, validate_config
from errors import UserError
from forward.batch import pack_batch
from plumbing.oom import OomReaction, base_sizes
from prompts.sets import load_prompts
from rewards.scoring import Scorer
from rollout.hf import HFEngine

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo_model"


def counted(obj, name: str, calls: list):
    """obj.name still runs; each call is counted in calls."""
    real = getattr(obj, name)

    def call(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    setattr(obj, name, call)


@pytest.fixture(scope="module")
def demo():
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    model = AutoModelForCausalLM.from_pretrained(DEMO).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def vllm_engine(demo):
    from rollout.vllm import VLLMEngine
    engine = VLLMEngine(DEMO, dtype="float32", seed=1, max_model_len=64, kv_cache_gb=0.25,
                        eos_token_id=demo[0].eos_token_id)
    yield engine
    engine.shutdown()


JUDGE = dict(reward_judge_path=str(ROOT / "examples" / "demo_judge_model"), reward_judge_range="0,9",
             reward_judge_template=str(ROOT / "examples" / "demo_judge_template.jinja"), reward_judge_max_tokens=1,
             reward_judge_prompt_length=32)


@pytest.mark.parametrize("kind, val_temperature", [("hf", 0.0), ("hf", 1.0), ("judge", 1.0),
                                                   pytest.param("vllm", 1.0, marks=pytest.mark.slow)])
def test_validation_in_rounds_gives_the_metrics_of_one_round(demo, request, kind, val_temperature):
    """7 prompts in rounds of 3 (3 rounds: 3, 3, 1): the same metrics and samples as all 7 at once,
    sampled too (each response's draws keyed to its place in the share), and the engine's random
    state (hf: torch's RNG; vLLM: its seed counter) moved on as after one call, so the training that
    follows samples the same. judge: the hf judge scores each round; its verdicts and unreadable
    count are those of one call."""
    import train_ppo
    tokenizer, model = demo
    cfg = Config(val_temperature=val_temperature, log_samples=7, max_response_length=6,
                 **(JUDGE if kind == "judge" else {}))
    val = load_prompts(cfg.val_files, cfg.prompt_key, tokenizer, cfg.max_prompt_length, "error").take(range(7))
    scorer, accelerator = Scorer(cfg, tokenizer, None), Accelerator(cpu=True)
    if kind == "judge":
        scorer.start(world=1, rank=0)
    vllm = request.getfixturevalue("vllm_engine") if kind == "vllm" else None
    start = vllm.state_dict() if vllm else None
    results = {}
    for size in (None, 3):
        engine, calls = vllm or HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, 2), []
        if vllm:
            vllm.load_state_dict(start)
        counted(engine, "generate", calls)
        torch.manual_seed(1)
        metrics, samples = train_ppo.run_validation(dataclasses.replace(cfg, val_batch_size=size), accelerator,
                                                    engine, scorer, tokenizer, val)
        after = vllm.state_dict() if vllm else torch.randint(2**62, ()).item()
        results[size] = (metrics, samples, len(calls), after)
        if vllm:
            del vllm.generate   # the counting wrapper, an instance attribute
    (one, one_samples, one_calls, one_next), (rounds, round_samples, round_calls, round_next) = results.values()
    assert (one_calls, round_calls) == (1, 3)
    assert rounds == one and round_samples == one_samples and round_next == one_next
    assert len(one_samples["response"]) == 7 and ("val/judge_parse_errors" in one if kind == "judge" else
                                                  "val/accuracy" in one)
    if kind == "judge":
        assert len(one_samples["judge"]) == 7


def test_validation_rounds_are_global_and_alike_on_every_rank():
    from train_ppo import validation_rounds, validation_share
    assert validation_rounds(7, 3, 1) == [(0, 3), (3, 6), (6, 7)]
    assert validation_rounds(7, None, 1) == validation_rounds(7, 0, 1) == [(0, 7)]
    for n, size, world in ((7, 3, 2), (3, 2, 2), (1, 4, 3), (10, 1, 4)):
        shares = [validation_share(n, world, rank) for rank in range(world)]
        rounds = [validation_rounds(len(idx), size, world) for idx, _ in shares]
        assert all(r == rounds[0] for r in rounds)                         # the same calls on every rank
        per_round = [sum(min(real, stop) - start for _, real in shares if real > start) for start, stop in rounds[0]]
        assert sum(per_round) == n                                           # each prompt once
        assert max(per_round) < size + world                                 # val_batch_size a round, rounded up per rank


def test_a_negative_val_batch_size_is_refused_in_one_line():
    with pytest.raises(UserError, match="val_batch_size must be >= 0") as e:
        validate_config(Config(val_batch_size=-1))
    assert "\n" not in str(e.value)


def tiny_lm(seed: int):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2)).float().eval()


BATCH = ([[3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13]], [[1, 2], [2], [3, 4, 5], [6, 7, 8, 9]])   # 4, 4, 8, 5 tokens


@pytest.mark.parametrize("own", [dict(ref_log_prob_micro_batch_size_per_device=1),
                                 dict(use_dynamic_bsz=True, log_prob_max_token_len_per_device=64,
                                      ref_log_prob_max_token_len_per_device=8)])
def test_the_reference_pass_takes_its_own_micro_batches(own):
    """forward_passes with a reference model: its pass follows ref_log_prob_* (more passes here)
    while the actor's keeps log_prob_*; the reference log-probs are the same numbers."""
    import train_ppo
    actor, ref = tiny_lm(0), tiny_lm(1)
    base = dict(log_prob_micro_batch_size_per_device=4, ppo_max_token_len_per_device=64)
    got = {}
    for extra in ({}, own):
        cfg = Config(**base, **extra)
        accelerator = Accelerator(cpu=True)
        run = SimpleNamespace(cfg=cfg, accelerator=accelerator, actor=actor, ref=ref, critic=None,
                              oom=OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries))
        passes = {"actor": [], "ref": []}
        hooks = [m.register_forward_hook(lambda *_, k=k: passes[k].append(1)) for k, m in (("actor", actor), ("ref", ref))]
        batch = pack_batch(*BATCH, pad_id=0)
        try:
            train_ppo.forward_passes(run, batch, 1.0)
        finally:
            for h in hooks:
                h.remove()
        got[bool(extra)] = (batch["ref_logprob"], len(passes["actor"]), len(passes["ref"]))
    (same_ref, same_actor_n, same_ref_n), (own_ref, own_actor_n, own_ref_n) = got[False], got[True]
    assert (same_actor_n, same_ref_n) == (1, 1) and own_actor_n == 1 and own_ref_n >= 3
    assert torch.allclose(own_ref, same_ref, atol=1e-5)


def test_the_trained_reward_model_by_token_budget_scores_as_by_count():
    """reward_model_use_dynamic_bsz: reward_micro_batch gives the token budget (the RM's own, or the
    log_prob one), the Scorer's passes follow it, and the scores are those of the sequence-count path."""
    cfg = Config(reward_model_path="rm", reward_model_micro_batch_size_per_device=4)
    assert reward_micro_batch(cfg) == (4, 0)
    assert reward_micro_batch(dataclasses.replace(cfg, reward_model_use_dynamic_bsz=True,
                                                  log_prob_max_token_len_per_device=512)) == (4, 512)
    budget = dataclasses.replace(cfg, reward_model_use_dynamic_bsz=True, reward_model_max_token_len_per_device=8)
    assert reward_micro_batch(budget) == (4, 8)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_labels=1,
                                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                    pad_token_id=0)).float().eval()
    scorer, passes = Scorer(cfg, None, rm), []
    rm.register_forward_hook(lambda *_: passes.append(1))
    batch = pack_batch(*BATCH, pad_id=0)
    by_count = scorer(None, BATCH[1], batch, *reward_micro_batch(cfg)[:1])
    count_passes = len(passes)
    micro, max_tokens = reward_micro_batch(budget)
    by_budget = scorer(None, BATCH[1], batch, micro, max_tokens=max_tokens, agree=lambda n: n + 1)
    assert count_passes == 1 and len(passes) - count_passes == 4   # 3 groups of <= 8 tokens, one more agreed
    assert torch.allclose(by_budget, by_count, atol=1e-5)
