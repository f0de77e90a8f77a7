"""DAPO's dynamic sampling (verl's algorithm.filter_groups): a prompt whose rollout_n responses all
have the same metric value gives every one of them zero advantage, so its group is dropped and
more prompts are sampled, round after round, until the batch is full.

Under several processes each rank generates and keeps its own groups; the rounds are decided
together: after each round the fewest groups any rank holds is agreed on (one collective every
rank runs), so every rank runs the same number of rounds (the same generate and reward-model
passes) and ends with exactly its share of train_batch_size groups.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

import torch

from config import Config
from errors import UserError
from forward.batch import is_truncated
from rewards.scoring import shape_scores


@dataclass
class Sampled:
    """Phases 1-2 on one rank: prompts (row indices), rollout_n responses each (prompt-major), one
    raw score per response."""
    idx: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]] | None     # the sampler's, per response token (the engine's RolloutOutput)
    scores: torch.Tensor                   # [b] the reward's raw scores (NaN/inf kept: collect drops them)
    tools: typing.Any = None               # multi-turn: the ToolRolloutOutput (not with dynamic sampling)

    def groups(self, keep: list[int], n: int) -> "Sampled":
        """The groups numbered keep, in that order."""
        rows = [g * n + j for g in keep for j in range(n)]
        return Sampled([self.idx[g] for g in keep], [self.responses[r] for r in rows],
                       None if self.logprobs is None else [self.logprobs[r] for r in rows], self.scores[rows])

    @staticmethod
    def concat(parts: list["Sampled"]) -> "Sampled":
        logprobs = None if any(p.logprobs is None for p in parts) else [x for p in parts for x in p.logprobs]
        return Sampled([i for p in parts for i in p.idx], [r for p in parts for r in p.responses], logprobs,
                       torch.cat([p.scores for p in parts]))


def varied_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    """values [b] of b / n consecutive groups -> [b / n] bool: the groups whose values are not all
    equal (verl keeps std > 0; a group of one is always kept, as in verl)."""
    grouped = values.view(-1, n)                                                  # [g, n]
    return (grouped != grouped[:, :1]).any(-1) | (n == 1)                         # [g]


def group_metric(cfg: Config, part: Sampled, eos_id, is_verifier: bool) -> torch.Tensor:
    """filter_groups_metric of each response -> [b]. seq_reward: the shaped score the update trains on
    (overlong and truncation penalties, clipping; verl's sum of token_level_scores); score: the raw
    score; acc: correct or not (a verifier's score >= 1, as reward/accuracy); seq_final_reward: verl's
    after KL in the reward, which config.py allows only without it, where it is seq_reward."""
    metric, scores = cfg.filter_groups_metric, part.scores
    finite = torch.isfinite(scores)
    if metric == "score":
        return torch.where(finite, scores, torch.zeros_like(scores))
    if metric == "acc":
        if not is_verifier:
            raise UserError(f"filter_groups_metric=acc needs a verifier (a reward_fn marked is_verifier); "
                            f"{cfg.reward_model_path or cfg.reward_fn} is not: use seq_reward or score")
        return ((scores >= 1.0) & finite).to(scores.dtype)
    truncated = is_truncated(part.responses, eos_id, cfg.max_response_length).to(scores.device)
    return shape_scores(cfg, torch.where(finite, scores, torch.zeros_like(scores)), part.responses, truncated,
                        finite)


def fill_groups(first: list[int], draw, sample, metric, agree_min, share: int, n: int, max_rounds: int,
                step: int) -> tuple[Sampled, dict]:
    """Rounds of sampling until every rank holds `share` groups whose metric varies.

    first: this rank's prompts for round 1; draw(): this rank's prompts for the next round (every
    rank draws alike, so the prompt stream stays in step); sample(idx, again) -> Sampled (again: not
    the first round); metric(Sampled)
    -> [b]; agree_min(count) -> the smallest count of any rank (a collective, called once per round
    on every rank). Returns the first `share` kept groups in the order sampled, and
    rollout/kept_groups_frac (kept / sampled groups over the rounds, before the trim) and
    rollout/gen_rounds."""
    kept, held, sampled, rounds, idx = [], 0, 0, 0, first
    while True:
        rounds += 1
        part = sample(idx, rounds > 1)
        keep = varied_groups(metric(part).cpu(), n)                               # [g]
        kept.append(part.groups(keep.nonzero().flatten().tolist(), n))
        held, sampled = held + int(keep.sum()), sampled + len(keep)
        fewest = agree_min(held)
        if fewest >= share:
            break
        if max_rounds and rounds >= max_rounds:
            raise UserError(f"step {step}: dynamic sampling (filter_groups_enable) holds {fewest} of the {share} groups "
                            f"a rank needs after max_num_gen_batches={max_rounds} generation rounds: too many prompts "
                            f"have responses that all score alike (filter_groups_metric); raise max_num_gen_batches "
                            f"(0 = no limit), use easier/harder data, or set filter_groups_enable=false")
        idx = draw()
    out = Sampled.concat(kept)
    return out.groups(list(range(share)), n), {"rollout/kept_groups_frac": held / sampled,
                                               "rollout/gen_rounds": float(rounds)}
