"""Reductions across ranks: rows gathered, metrics averaged once per step, counts agreed on.
"""
from __future__ import annotations

import math
import zlib

import torch

from forward import ulysses


def _over_ranks(accelerator, pick):
    def agree(count: int) -> int:
        if accelerator.num_processes == 1:
            return count
        return int(pick(accelerator.gather(torch.tensor([count], device=accelerator.device))))
    return agree


def max_over_ranks(accelerator):
    """count -> the largest count of any rank; a collective, so every rank calls it together."""
    return _over_ranks(accelerator, torch.max)


def min_over_ranks(accelerator):
    """count -> the smallest count of any rank; a collective, so every rank calls it together."""
    return _over_ranks(accelerator, torch.min)


def any_over_ranks(accelerator):
    """local flag -> whether any rank's is set; a collective, so every rank calls it together."""
    agree = max_over_ranks(accelerator)
    return lambda local: agree(int(bool(local))) > 0


def median_over_ranks(accelerator, values) -> float:
    """The median of every rank's values [b] together, the same number on every rank (a collective):
    gathered, since a mean of per-rank medians is not the median."""
    return float(accelerator.gather(values.double()).quantile(0.5))


def gather_rows(accelerator, t):
    """Every data-parallel rank's [b, R_rank] (or [b]) rows -> the whole batch [B, R_max] (or [B]) on
    every rank, in rank order. The ranks of a sequence-parallel group hold the same rows: the
    group's first rank stands for it."""
    rows = accelerator.gather(accelerator.pad_across_processes(t, dim=1) if t.dim() > 1 else t)   # [world * b, ...]
    sp = ulysses.size()
    if sp == 1:
        return rows
    return rows.view(-1, sp, t.shape[0], *rows.shape[1:])[:, 0].reshape(-1, *rows.shape[1:])     # [dp * b, ...]


def reduce_metrics(accelerator, metrics: dict, how: str = "mean") -> dict:
    """Mean (how="max": the largest) of each metric over the ranks where it is not NaN (NaN where it
    is on all), all in one collective, after a 2-number one that checks every rank has the same
    keys: ranks reducing different key lists would hang, or abort, or pair values with the wrong names."""
    if accelerator.num_processes == 1:
        return metrics
    keys = sorted(metrics)
    signature = torch.tensor([len(keys), zlib.crc32("\n".join(keys).encode())], dtype=torch.float64,
                             device=accelerator.device)
    if (accelerator.gather(signature).view(-1, 2) != signature).any():
        from accelerate.utils import gather_object
        every = gather_object([keys])
        odd = sorted(set().union(*every) - set.intersection(*map(set, every)))
        raise RuntimeError(f"ranks reduce different metric keys (a metric must not depend on a rank's data): {odd}")
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=accelerator.device)  # [n]
    seen = ~values.isnan()                                                                                   # [n]
    if how == "max":
        top = accelerator.reduce(torch.where(seen, values, -math.inf), reduction="max")                       # [n]
        return dict(zip(keys, torch.where(top > -math.inf, top, math.nan).tolist()))
    sums = accelerator.reduce(torch.cat([torch.where(seen, values, 0.0), seen.double()]), reduction="sum")   # [2n]
    total, count = sums[:len(keys)], sums[len(keys):]
    return dict(zip(keys, torch.where(count > 0, total / count.clamp(min=1), float("nan")).tolist()))
