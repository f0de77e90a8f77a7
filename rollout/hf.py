"""The hf engine: sampling with Hugging Face `generate` on the actor itself (no second copy).

Because it generates with the training weights, there is nothing to sync, sleep or wake.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Iterable

import torch
from transformers import GenerationConfig

from rollout import RolloutOutput, SamplingParams, cut_at_eos


class HFEngine:
    name = "hf"

    def __init__(self, model, eos_token_id: int | list[int], pad_token_id: int, micro_batch_size: int = 256,
                 contexts=()):
        self.model = model                  # the unwrapped actor (an nn.Module with .generate)
        self.eos_ids = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        self.pad_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        # context-manager factories entered around each generate() call: e.g. gathering ZeRO-3
        # shards once per rollout, bf16 autocast
        self.contexts = list(contexts)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        greedy = params.temperature == 0
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_tokens, do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy or params.top_k <= 0 else params.top_k,
            eos_token_id=None if params.ignore_eos else sorted(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        expanded = [p for p in prompts for _ in range(params.n)]
        responses = []
        # generate() fills unset values from model.generation_config, which would bring the
        # model's EOS back even with ignore_eos: swap it out for the duration of the call.
        saved_cfg, was_training = self.model.generation_config, self.model.training
        self.model.generation_config = gen_cfg
        self.model.eval()
        try:
            with torch.no_grad(), ExitStack() as stack:
                for make_context in self.contexts:
                    stack.enter_context(make_context())
                for i in range(0, len(expanded), self.micro_batch_size):
                    responses += self._generate_chunk(expanded[i:i + self.micro_batch_size], gen_cfg)
        finally:
            self.model.generation_config = saved_cfg
            self.model.train(was_training)
        return RolloutOutput(responses=responses, logprobs=None)

    def _generate_chunk(self, prompts: list[list[int]], gen_cfg: GenerationConfig) -> list[list[int]]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)      # [b, P] left-padded
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = self.model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg,
                                  synced_gpus=False)   # the caller provides full weights (contexts)
        new_tokens = out[:, width:].tolist()                                           # [b, <=R]
        if gen_cfg.eos_token_id is None:   # ignore_eos: every sampled token counts
            return new_tokens
        return [cut_at_eos(t, self.eos_ids) for t in new_tokens]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass   # generation runs on the actor's own parameters

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}   # sampling draws from torch's RNG, which the checkpoint saves anyway

    def load_state_dict(self, state: dict) -> None:
        pass
