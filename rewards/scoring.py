"""Scoring: the reward function (reward_fn "module:function") or reward model turned into one
score per sequence, then shaped (clipping, overlong penalty); core_algos.place_scores spreads it over
the response tokens.
"""
from __future__ import annotations

import math

import torch

from config import Config
from core_algos import overlong_penalty
from errors import UserError
from forward.batch import forward_in_micro_batches
from forward.readouts import reward_model_scores
from prompts.sets import PromptSet
from rewards.functions import load_function

def load_reward_fn(spec: str):
    fn = load_function(spec)
    name = spec.split(":", 1)[1]
    import inspect
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):   # some builtins have none to check
        return fn
    try:   # called as fn(prompts, responses, **columns): refused now rather than after the first rollout
        signature.bind([], [], **{column: [] for column in reward_fn_columns(fn)})
    except TypeError as e:
        raise UserError(f"reward_fn {spec!r}: {name}{signature} cannot be called as {name}(prompts, responses, "
                        f"<dataset columns as keywords>): {e}") from None
    return fn


def reward_fn_columns(fn) -> list[str]:
    """A reward function's parameters after (prompts, responses) name dataset columns it needs."""
    import inspect
    params = list(inspect.signature(fn).parameters.values())[2:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def score_with_fn(fn, spec: str, prompts: list[str], responses: list[str], columns: dict,
                  allow_nonfinite: bool = False) -> torch.Tensor:
    """One finite float per sample, or a UserError naming the sample (with allow_nonfinite, NaN/inf
    pass through for the caller to drop)."""
    try:
        scores = list(fn(prompts, responses, **columns))
    except Exception as e:
        raise UserError(f"reward_fn {spec} raised {type(e).__name__}: {e} (batch of {len(prompts)}, first prompt "
                        f"{prompts[0]!r}, response {responses[0]!r})") from e
    if len(scores) != len(prompts):
        raise UserError(f"reward_fn {spec} returned {len(scores)} scores for {len(prompts)} samples")
    for i, s in enumerate(scores):
        if not isinstance(s, (int, float)) or not (math.isfinite(s) or allow_nonfinite):
            raise UserError(f"reward_fn {spec} returned {s!r} for sample {i}: prompt {prompts[i]!r}, "
                            f"response {responses[i]!r}")
    return torch.tensor(scores, dtype=torch.float32)


class Scorer:
    """The reward: a verifier/reward function on decoded text, an LLM judge's verdicts on it
    (rewards/judge.py), or a reward model on token ids."""

    def __init__(self, cfg: Config, tokenizer, reward_model):
        self.cfg, self.tokenizer, self.reward_model = cfg, tokenizer, reward_model
        self.judge = self.served = None   # served: the reward model on a vLLM pooling engine
        if cfg.reward_judge_path:   # its template and parser are read now; setup starts its engine
            from rewards.judge import Judge
            self.judge = Judge(cfg)
        self.fn = None if cfg.reward_model_path or self.judge else load_reward_fn(cfg.reward_fn)
        self.is_verifier = bool(getattr(self.fn, "is_verifier", False))
        self.columns = self.judge.columns if self.judge else reward_fn_columns(self.fn) if self.fn else []
        self.source = (f"reward_judge_template {cfg.reward_judge_template}" if self.judge else
                       f"reward_fn {cfg.reward_fn}")   # what reads the dataset columns
        self.verdicts: list[str] | None = None       # the judge's raw outputs of the last call
        self.unreadable: list[bool] = []             # which of them scored the fallback
        self.judge_errors = 0                        # unreadable verdicts since take_judge_errors()

    def start(self, world: int, rank: int, device=None) -> None:
        """The engine the reward runs on, if it has one of its own: the judge's, or the served
        reward model's (reward_model_engine=vllm); asleep until it scores."""
        if self.judge is not None:
            self.judge.start(world, rank, device)
        if self.cfg.reward_model_path and self.cfg.reward_model_engine == "vllm":
            from rollout.vllm import VLLMClassifier
            cfg = self.cfg
            try:
                self.served = VLLMClassifier(cfg.reward_model_path, dtype=cfg.dtype,
                                             max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                                             gpu_memory_utilization=cfg.reward_model_gpu_memory_utilization,
                                             kv_cache_gb=cfg.reward_model_kv_cache_gb, distributed=world > 1)
            except RuntimeError as e:
                why = " ".join(line.strip() for line in str(e).splitlines()[:2])
                raise UserError(f"reward_model_engine=vllm: {why} (reward_model_kv_cache_gb (CPU), "
                                "reward_model_gpu_memory_utilization (GPU), or reward_model_engine=trained)") from None
            self.served.sleep()

    def shutdown(self) -> None:
        for engine in (self.judge, self.served):
            if engine is not None:
                engine.shutdown()

    def take_judge_errors(self) -> int:
        """The unreadable verdicts counted since the last call (reward/judge_parse_errors)."""
        errors, self.judge_errors = self.judge_errors, 0
        return errors

    def __call__(self, prompts: PromptSet, responses: list[list[int]], batch: dict, micro: int,
                 trajectory: dict | None = None, max_tokens: int = 0, agree=None) -> torch.Tensor:
        """trajectory (multi-turn): messages, tool_calls, tool_errors, env_reward per sample; the
        function gets those it names as parameters, and the environment's reward is added. micro,
        max_tokens, agree: the trained reward model's micro-batches (forward_in_micro_batches): micro
        sequences each, or with max_tokens > 0 that token budget, agree(count) the passes every rank runs."""
        trajectory = trajectory or {}
        if self.served is not None:   # every real token of each sequence, unpadded: vLLM reads the last
            real = batch["attention_mask"].bool().cpu()
            sequences = [ids[keep].tolist() for ids, keep in zip(batch["input_ids"].cpu(), real)]
            self.served.wake_up()
            scores = torch.tensor(self.served.score(sequences), dtype=torch.float32)
            self.served.sleep()
        elif self.reward_model is not None:
            scores = forward_in_micro_batches(lambda mb: reward_model_scores(self.reward_model, mb), batch, micro,
                                              max_tokens, agree)
        elif self.judge is not None:
            texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            scores, self.verdicts, self.unreadable = self.judge(prompts.texts, texts, prompts.columns)
            self.judge_errors += sum(self.unreadable)
        else:
            texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            columns = {**prompts.columns, **{k: v for k, v in trajectory.items() if k in self.columns}}
            scores = score_with_fn(self.fn, self.cfg.reward_fn, prompts.texts, texts, columns,
                                   self.cfg.skip_nonfinite_rewards)
        if "env_reward" in trajectory:
            scores = scores + torch.tensor(trajectory["env_reward"], dtype=scores.dtype, device=scores.device)
        return scores                                                             # [B]

    def dataset_columns(self, trajectory_columns=()) -> list[str]:
        """The columns to read from the data: what the function takes, less what a trajectory provides."""
        return [c for c in self.columns if c not in trajectory_columns]


def shape_scores(cfg: Config, scores, responses, truncated, valid=None, bonus=None):
    """Training rewards from raw scores: DAPO overlong shaping, the truncation penalty, a bonus (the
    multi-turn tool_call_bonus), then clipping; a dropped sample (valid False: a non-finite score)
    gets 0, no penalty. Validation and reward/* metrics report the raw scores.

    responses: the token lists; overlong shaping measures each whole, tool tokens included, since
    max_response_length is the whole trajectory's budget (verl's DAPO reward manager shapes on the
    valid response length), not the count of the model's own tokens."""
    if cfg.overlong_buffer_len > 0:
        lengths = torch.tensor([len(r) for r in responses], dtype=scores.dtype, device=scores.device)   # [B]
        scores = scores + overlong_penalty(lengths, cfg.max_response_length, cfg.overlong_buffer_len,
                                           cfg.overlong_penalty_factor)
    if cfg.truncation_penalty:
        scores = scores - cfg.truncation_penalty * truncated.to(scores.dtype)
    if bonus is not None:
        scores = scores + bonus.to(scores)
    if cfg.reward_clip > 0:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    if valid is not None:
        scores = torch.where(valid, scores, torch.zeros_like(scores))
    return scores                                                                 # [B]
