"""Batch layout: rollouts as left-padded tensors, rows selected and moved, and the batch cut into
mini-batches and micro-batches (by count or by a token budget).
"""
from __future__ import annotations


import torch


def token_budget_splits(lengths: list[int], max_tokens: int, n_groups: int = 0) -> list[list[int]]:
    """Groups of sequence indices whose total length stays within max_tokens (a longer sequence
    goes alone): micro-batches by token count rather than sequence count. Longest first, each into
    the first group with room (first-fit decreasing). With n_groups above the number needed, the
    fullest groups are halved until there are exactly n_groups: under ZeRO-3 every rank must run
    as many forward passes as the others. Indices ascend within a group."""
    if n_groups > len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {n_groups} non-empty groups")
    groups: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        room = next((g for g, u in enumerate(used) if u + lengths[i] <= max_tokens), None)
        if room is None:
            groups.append([])
            used.append(0)
            room = len(groups) - 1
        groups[room].append(i)
        used[room] += lengths[i]
    while len(groups) < n_groups:
        fullest = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: used[g])
        members = sorted(groups[fullest], key=lambda i: -lengths[i])
        groups[fullest], half = members[0::2], members[1::2]
        used[fullest] = sum(lengths[i] for i in groups[fullest])
        groups.append(half)
        used.append(sum(lengths[i] for i in half))
    return [sorted(g) for g in groups]


def pack_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict:
    """Prompts left-padded to P, responses right-padded to R: one [B, P + R] sequence each."""
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    R = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)                  # [B, P+R]
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)                    # [B, P+R]
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, P - len(p):P + len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                   # [B, P+R]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": input_ids[:, P:], "response_mask": attention_mask[:, P:].float()}   # [B, R]


def select(batch: dict, idx) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")   # [B, P + R]; every other 2-d entry is [B, R]


def trim_padding(batch: dict) -> dict:
    """Drop the columns every row pads: left of the longest prompt and right of the longest
    response, so a micro-batch computes on its own width, not the whole batch's."""
    R = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - R
    attn = batch["attention_mask"]
    used = attn[:, :P].any(0)                                                      # [P]
    left = int(used.float().argmax()) if used.any() else P
    r = max(1, int(attn[:, P:].sum(-1).max()))
    return {k: v[:, left:P + r] if k in SEQUENCE_KEYS else v[:, :r] if v.dim() > 1 else v for k, v in batch.items()}


def mini_batches(batch: dict, size: int):
    n = batch["input_ids"].shape[0]
    for start in range(0, n, size):
        yield select(batch, slice(start, start + size))


def spread(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """values [n] at the n True places of where [N] -> [N], zeros elsewhere (differentiable)."""
    return values.new_zeros(where.shape).masked_scatter(where, values)


def micro_batches(batch: dict, size: int, max_tokens: int = 0, agree=None) -> list[tuple[torch.Tensor, dict]]:
    """-> [(row indices, micro-batch)]: `size` sequences of similar length each, or with
    max_tokens > 0 groups within that token budget, each trimmed to its own longest sequence. agree(count) -> the count
    every rank uses (the max over ranks): token budgets split each rank's sequences differently,
    and under ZeRO-3 a rank running one pass fewer than the others would hang them."""
    n = batch["input_ids"].shape[0]
    if max_tokens > 0:
        lengths = batch["attention_mask"].sum(-1).tolist()
        groups = token_budget_splits(lengths, max_tokens)
        wanted = agree(len(groups)) if agree else len(groups)
        if wanted > len(groups):   # another rank needs more passes: split to match
            groups = token_budget_splits(lengths, max_tokens, wanted)
        parts = [torch.tensor(g) for g in groups]
    else:   # similar lengths together, so trimming leaves little padding
        order = torch.argsort(batch["attention_mask"].sum(-1), stable=True)       # [n]
        parts = [order[start:start + size] for start in range(0, n, size)]
    return [(idx, trim_padding(select(batch, idx))) for idx in parts]


@torch.no_grad()
def forward_in_micro_batches(fn, batch: dict, size: int, max_tokens: int = 0, agree=None) -> torch.Tensor:
    """fn on each micro-batch, the rows put back in batch order -> [B] or [B, R, ...] (zeros where a
    trimmed micro-batch had no column)."""
    out = None
    for idx, mb in micro_batches(batch, size, max_tokens, agree):
        part = fn(mb)                                                             # [b] or [b, r, ...]
        if out is None:
            shape = (batch["input_ids"].shape[0],) + ((batch["responses"].shape[1], *part.shape[2:])
                                                      if part.dim() > 1 else ())
            out = torch.zeros(shape, dtype=part.dtype, device=part.device)
        if part.dim() > 1:
            out[idx.to(part.device), :part.shape[1]] = part
        else:
            out[idx.to(part.device)] = part
    return out


def is_truncated(responses: list[list[int]], eos_id: int, max_len: int) -> torch.Tensor:
    """[B] True where a response was cut at max_len without an EOS."""
    return torch.tensor([len(r) >= max_len and r[-1] != eos_id for r in responses])


def sampler_logprobs(logprobs: list[list[float]], mask) -> torch.Tensor:
    """The sampler's per-token log-probs, right-padded like the responses -> [B, R]."""
    sampler = torch.zeros_like(mask)
    for i, lp in enumerate(logprobs):
        sampler[i, :len(lp)] = torch.tensor(lp, dtype=sampler.dtype)
    return sampler
