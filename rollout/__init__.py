"""Rollout engines: one small protocol, interchangeable implementations (rollout_engine: hf | vllm).

An engine turns prompt token ids into sampled response token ids. Everything model-specific
(HF `generate`, vLLM's LLM object) stays inside the engine's own file; train_ppo.py only sees
this protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch


@dataclass
class SamplingParams:
    n: int = 1                    # samples per prompt; outputs are prompt-major (p0s0, p0s1, ..., p1s0, ...)
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 = off (vLLM's convention)
    max_tokens: int = 16
    ignore_eos: bool = False      # keep sampling past EOS: fixed-length responses for benchmarks
    seed: int | None = None       # the call's sampling seed (rollout/asynchronous.py gives it); None = the engine's own:
                                  # hf from torch's RNG, vllm its counter


@dataclass
class RolloutOutput:
    responses: list[list[int]]             # [B * n] token ids, cut after the first EOS (kept)
    logprobs: list[list[float]] | None     # each response token's log-prob under the distribution it was drawn
                                           # from (top_k/top_p cut, renormalised); None for greedy (hf)

    @staticmethod
    def concat(parts: list["RolloutOutput"]) -> "RolloutOutput":
        """The outputs of consecutive parts of one batch (e.g. Share), as one output in their order."""
        logprobs = None if any(p.logprobs is None for p in parts) else [lp for p in parts for lp in p.logprobs]
        return RolloutOutput([r for p in parts for r in p.responses], logprobs)


@dataclass(frozen=True)
class Share:
    """Which prompts of a batch of `total` a generate() call samples when other calls sample the
    rest (the other ranks of a sequence-parallel group; multi-turn rollouts' other passes): rows[i]
    is prompts[i]'s place in the batch. The engines key a response's random draws to that place
    (x n + its sample), not to the call it came in: shares sample what one call on the whole batch
    would, and the engine's random state moves on as after the whole batch, alike on every rank.
    batch: which batch (the global rank of its group's first member), for an engine that serves
    several ranks (vLLM tensor parallelism) to tell shares of one batch from different batches."""
    rows: tuple[int, ...]
    total: int
    batch: int = 0

    @staticmethod
    def of(first: int, count: int, total: int, batch: int = 0) -> "Share":
        return Share(tuple(range(first, first + count)), total, batch)

    def keys(self, n: int) -> list[int]:
        """Each response's place in the batch: prompt-major, n samples a prompt."""
        return [row * n + s for row in self.rows for s in range(n)]


class RolloutEngine(Protocol):
    name: str                                                     # "hf" | "vllm"
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 share: Share | None = None) -> RolloutOutput: ...   # share None: the whole batch
    def draw_seed(self, params: SamplingParams, prompts: int) -> int | None: ...   # one call's seed: see HFEngine
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def sleep(self) -> None: ...                                  # after generating: free GPU memory
    def wake_up(self, tags: list[str] | None = None) -> None: ...  # "weights" before a sync, "kv_cache" before generating
    def shutdown(self) -> None: ...
    def state_dict(self) -> dict: ...                            # plain JSON, saved in checkpoints per rank
    def load_state_dict(self, state: dict) -> None: ...


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Response tokens up to and including the first EOS (generate pads only after an EOS)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens
