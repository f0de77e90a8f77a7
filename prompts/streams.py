"""Streams over the sets: which rows each step takes, in an order that resumes exactly.
"""
from __future__ import annotations

import math

import torch

from config import Config, schedule
from errors import UserError
from forward.batch import pack_batch


class PromptStream:
    """Each epoch a fresh seeded permutation of the training prompts, consumed in batches."""

    def __init__(self, n: int, batch_size: int, seed: int, names=("train_files", "train_batch_size")):
        if n < batch_size:
            raise UserError(f"{names[0]} hold {n} rows, fewer than {names[1]}={batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.pos = 0, 0

    def next(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        idx = order[self.pos:self.pos + self.batch_size].tolist()
        self.pos += self.batch_size
        return idx


class SFTStream:
    """The SFT mix's rows, drawn in seeded permutations like the prompts: every rank draws the same
    rows and takes its own share, so each rank runs exactly one SFT pass per mini-batch."""

    def __init__(self, pairs, batch_size: int, seed: int, rank: int, world: int, pad_id: int):
        self.prompts, self.responses = pairs
        self.rank, self.world, self.pad_id = rank, world, pad_id
        self.rows = PromptStream(len(self.prompts), batch_size, seed, names=("sft_files", "sft_batch_size"))

    def next(self) -> dict:
        idx = self.rows.next()[self.rank::self.world]
        return pack_batch([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.pad_id)


def sft_batch_size(cfg: Config, world: int) -> int:
    """sft_batch_size, or 5% of an actor mini-batch's sequences rounded up to one per process."""
    if cfg.sft_batch_size:
        return cfg.sft_batch_size
    share = math.ceil(0.05 * schedule(cfg, "actor").mini_batch * cfg.rollout_n / world)
    return max(1, share) * world
