"""PPO for language models in one flat file: verl's algorithm, the Hugging Face stack.

An actor is trained with PPO against a reward (a verifier function or a reward model), with a
critic for GAE (or a critic-free estimator), a frozen reference model for KL regularisation (KL
in the reward with a fixed or adaptive controller, and/or KL as a loss; see kl/), dual-clip,
value clipping, entropy bonus and gradient clipping. The math is verl 0.9.1's, as pure functions in
core_algos.py; one iteration is the numbered phases of `train_step` (1-7) and of the loop in `main` (8);
the update is below; what the story leans on lives in modules named by concern (docs/architecture.md).

    python train_ppo.py                                    # built-in demo: tiny model, arithmetic, CPU
    python train_ppo.py --config configs/demo.yaml --total_training_steps=20 --output_dir runs/x
    accelerate launch --config_file accelerate_configs/zero3.yaml train_ppo.py --config configs/X.yaml

Outputs: <output_dir>/config.yaml, <output_dir>/metrics.jsonl (one line per step), an MLflow run
(local SQLite store unless MLFLOW_TRACKING_URI says otherwise) and <output_dir>/final/ (the actor
in Hugging Face format).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

import kl
from config import (Config, HERE, _split_files, config_warnings, critic_checkpointing, load_config, reward_micro_batch,
                    sampling_cut, schedule, total_steps)
from core_algos import (agg_loss, compute_gae, compute_grpo_advantages, compute_reinforce_pp_advantages,
                        compute_reinforce_pp_baseline_advantages, compute_rloo_advantages, explained_variance,
                        kl_in_reward, masked_mean, masked_sum, pf_ppo_resample, place_scores, policy_loss,
                        rollout_is_weights, value_loss)
from distribution import plugins as distributed
from distribution.plugins import gathered_params, param_share
from distribution.prepare import check_world_size, make_accelerator, prepare_models
from distribution.reductions import (any_over_ranks, gather_rows, max_over_ranks, median_over_ranks, min_over_ranks,
                                     reduce_metrics)
from errors import UserError
from forward.batch import (forward_in_micro_batches, is_truncated, micro_batches, mini_batches, pack_batch,
                           sampler_logprobs, select, to_device)
from forward import grad_blocks, ulysses
from forward.readouts import _unwrap, critic_values, response_logprobs
from modeling.loading import load_models, recompute_activations
from plumbing import config_docs, console, flops, host_memory, lean_imports, model_card
from plumbing.checkpoints import (StopSignal, check_resumable, find_checkpoint, load_checkpoint, read_state,
                                  save_checkpoint, save_final)
from plumbing.dry_run import dry_run
from plumbing.guards import Guards, rescale_lr, resumed_lr_scale
from plumbing.host_memory import peak_memory_gb
from plumbing.oom import OomReaction, base_sizes
from plumbing.tracking import Tracker, run_tags
from prompts.sets import PromptSet, load_prompts, load_sft
from prompts.streams import PromptStream, SFTStream, sft_batch_size
from rewards.scoring import Scorer, shape_scores
from rollout import SamplingParams
from rollout.asynchronous import RolloutSide
from rollout.dynamic_sampling import Sampled, fill_groups, group_metric
from rollout.engines import fresh_mismatch_warning, generate_split, make_engine
from rollout.sync import actor_weights
from rollout.tools.rollouts import TRAJECTORY_COLUMNS, make_tool_rollouts


# ----------------------------------------------------------------------------------------------
# The update: ppo_epochs x mini-batches x micro-batches, one optimizer step per mini-batch.
# ----------------------------------------------------------------------------------------------
def mini_batch_norms(accelerator, mask, cfg: Config) -> dict:
    """Denominators for agg_loss over one whole mini-batch (all micro-batches, all ranks), so the
    micro-batch losses sum to the mini-batch loss. Gradients are averaged over ranks, hence the
    division by the world size (verl's dp_size factor)."""
    counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().to(mask.dtype)])
    counts = accelerator.reduce(counts, reduction="sum") / accelerator.num_processes
    return {"num_tokens": counts[0], "num_seqs": counts[1], "seq_len": cfg.max_response_length}


def backward(model, loss, ds: bool):
    # DeepSpeed would divide by its accumulation steps; our micro-batch losses already sum to the
    # mini-batch loss, so it must not
    model.backward(loss, scale_wrt_gas=False) if ds else loss.backward()


def optimizer_step(model, optim, max_norm: float, ds: bool) -> tuple[float, bool]:
    """Clip and step; a non-finite gradient norm skips the step (grads dropped) -> (norm, skipped)."""
    if ds:
        # the engine reduces the accumulated gradients, clips them to its gradient_clipping
        # (= max_norm), steps and zeroes them; ZeRO skips a step whose gradients overflow
        skipped_before = model.skipped_steps
        distributed.set_gradient_clipping(model, max_norm)   # a guard may have moved it
        model.step()
        norm = model.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        return norm, model.skipped_steps > skipped_before or not math.isfinite(norm)
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = float(total)
    if not math.isfinite(norm):
        grad_blocks.zero_grad(optim)
        return norm, True
    if float(max_norm / (total + 1e-6)) < 1.0:   # clip_grad_norm_'s scaling, but for a factor of 1 (no bit changes)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    optim.step()
    grad_blocks.zero_grad(optim)   # set to None; a [V, H] block is kept for the next step's backward (grad_blocks)
    return norm, False


def drop_gradients(model, optim, ds: bool) -> None:
    """The gradients a failed try accumulated, dropped before it is redone (ZeRO-3's zero_grad
    also restarts its accumulation, so the next backward overwrites its partitioned buffers)."""
    (model.optimizer if ds else optim).zero_grad(set_to_none=True)


def actor_loss(cfg: Config, micro: dict, logprob, entropy, norms: dict, entropy_coeff: float):
    """verl's actor loss on one micro-batch -> (loss, pg_loss, pg_stats, kl_loss or None): the
    clipped policy loss, minus the entropy bonus, plus the KL loss against the reference, each
    aggregated by loss_agg_mode over the whole mini-batch (norms), so the micro-batch losses sum to
    the mini-batch's. A sum of per-token terms: the chunked head can differentiate it in its pass."""
    m = micro["response_mask"]                                                    # [b, R]
    low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    pg, pg_stats = policy_loss(micro["old_logprob"], logprob, micro["advantages"], m, low, high, cfg.clip_ratio_c,
                               cfg.loss_agg_mode, micro.get("is_weights"), **norms)
    loss, kl_loss = pg, None
    if entropy_coeff:
        loss = loss - entropy_coeff * agg_loss(entropy, m, cfg.loss_agg_mode, **norms)
    if cfg.use_kl_loss:
        kl_loss = agg_loss(kl.kl_penalty(logprob, micro["ref_logprob"], cfg.kl_loss_type), m, cfg.loss_agg_mode,
                           **norms)
        loss = loss + cfg.kl_loss_coef * kl_loss
    return loss, pg, pg_stats, kl_loss


def update_actor(accelerator, actor, optim, batch: dict, cfg: Config, autocast, ds: bool, sft=None,
                 temperature: float = 1.0, entropy_coeff: float = 0.0, *, oom, max_grad_norm: float) -> dict:
    """ppo_epochs x mini-batches x micro-batches, one optimizer step per mini-batch: each
    micro-batch's forward, actor_loss, backward. Beside it, each under its own name: the OOM
    reaction (a mini-batch redone from the same rollouts with smaller micro-batches, its partial
    gradients dropped: oom.py), the entropy guard's measure (EntropyGuard), bypass mode's measures
    (BypassMeasures) and the SFT mix (sft_pass, on rows drawn once per mini-batch)."""
    stats = Stats()
    sched = schedule(cfg, "actor")
    mini = sched.mini_batch * cfg.rollout_n // ulysses.data_parallel(accelerator)[0]   # per data-parallel rank
    agree = max_over_ranks(accelerator)
    guard, bypass = EntropyGuard(cfg, temperature), BypassMeasures(cfg)

    def mini_batch(mb: dict, epoch: int, first: bool, sft_rows: dict | None) -> Stats:
        done = Stats()   # this try's figures: a try that runs out of memory leaves none
        norms = mini_batch_norms(accelerator, mb["response_mask"], cfg)
        pg_total, kl_total = 0.0, 0.0
        for _, micro in micro_batches(mb, *oom.size("actor"), agree):
            guard.extra_pass(actor, micro, epoch, autocast, oom, done)   # in its own agreed block
            with oom.agreed("actor"):   # forward and loss: every rank agrees before any backward
                with autocast():   # the entropy only where the loss or a measure reads it; the head differentiates the loss
                    logprob, entropy = response_logprobs(
                        actor, micro, temperature,
                        with_entropy=bool(entropy_coeff) or guard.reads_update(epoch) or bypass.on(epoch),
                        entropy_grad=entropy_coeff != 0,
                        loss_of=lambda lp, ent: actor_loss(cfg, micro, lp, ent, norms, entropy_coeff)[0])
                guard.record(entropy, micro, epoch, done)
                bypass.record(logprob, entropy, micro, epoch, first, done)
                loss, pg, pg_stats, kl_loss = actor_loss(cfg, micro, logprob, entropy, norms, entropy_coeff)
                if cfg.use_kl_loss:
                    kl_total += kl_loss.item()
            with oom.agreed("actor"):
                backward(actor, loss, ds)
            pg_total += pg.item()
            done.add({f"actor/{k}": v.item() for k, v in pg_stats.items()})
        sft_pass(accelerator, actor, sft_rows, cfg.sft_coef, autocast, ds, oom, done)
        grad_norm, skipped = optimizer_step(actor, optim, max_grad_norm, ds)
        done.add({"actor/pg_loss": pg_total, **({"actor/kl_loss": kl_total} if cfg.use_kl_loss else {})})
        done.add({"actor/grad_norm": grad_norm if not skipped else float("nan")})
        done.count("actor/skipped_steps", skipped)
        return done

    for epoch in range(sched.epochs):
        for i, mb in enumerate(mini_batches(batch, mini)):
            sft_rows = sft.next() if sft is not None else None   # drawn once: a redo trains on the same rows
            stats.merge(oom.retry("actor", lambda: mini_batch(mb, epoch, epoch == 0 and i == 0, sft_rows),
                                  lambda: drop_gradients(actor, optim, ds)))
    grad_blocks.release()
    return bypass.finish(accelerator, stats, stats.means())


# The reactions around the actor update, each under its own name.
class EntropyGuard:
    """guard/entropy (entropy_floor): the policy's entropy at the configured temperature, which a
    reacted sampling temperature does not move, over the first epoch. While sampling at that
    temperature the update's own pass gives it; otherwise one more no-grad pass per micro-batch,
    in its own agreed block (an OOM there is agreed on before the training forward's collectives).
    Every rank reacts alike, so every rank runs the same passes."""

    def __init__(self, cfg: Config, temperature: float):
        self.cfg = cfg
        self.apart = bool(cfg.entropy_floor) and temperature != cfg.temperature

    def reads_update(self, epoch: int) -> bool:
        return bool(self.cfg.entropy_floor) and not self.apart and epoch == 0

    def extra_pass(self, actor, micro: dict, epoch: int, autocast, oom, done: "Stats") -> None:
        if self.apart and epoch == 0:
            with oom.agreed("actor"), autocast(), torch.no_grad():
                _, at_config = response_logprobs(actor, micro, self.cfg.temperature, with_entropy=True)
            done.add({"guard/entropy": masked_mean(at_config, micro["response_mask"]).item()})

    def record(self, entropy, micro: dict, epoch: int, done: "Stats") -> None:
        if self.reads_update(epoch):
            done.add({"guard/entropy": masked_mean(entropy.detach(), micro["response_mask"]).item()})


class BypassMeasures:
    """rollout_bypass_mode skips the old-log-prob pass, so the update measures what it gave:
    actor/entropy over the first epoch, and rollout/logprob_diff over the first mini-batch (the one
    pass at the sampler's weights), token-weighted over every rank as sampler_drift gives it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def on(self, epoch: int) -> bool:
        return self.cfg.rollout_bypass_mode and epoch == 0

    def record(self, logprob, entropy, micro: dict, epoch: int, first: bool, done: "Stats") -> None:
        if not self.on(epoch):
            return
        m = micro["response_mask"]                                                # [b, R]
        done.add({"actor/entropy": agg_loss(entropy.detach(), m, self.cfg.loss_agg_mode,
                                            seq_len=self.cfg.max_response_length).item()})
        if first:   # summed here, divided once over every rank's tokens in finish
            done.total("logprob_diff", masked_sum((logprob.detach() - micro["old_logprob"]).abs(), m))
            done.total("logprob_diff_tokens", m.sum())

    def finish(self, accelerator, stats: "Stats", out: dict) -> dict:
        if self.cfg.rollout_bypass_mode:   # a collective: every rank runs it
            sums = torch.tensor([stats.totals.get("logprob_diff", 0.0), stats.totals.get("logprob_diff_tokens", 0.0)],
                                dtype=torch.float64, device=accelerator.device)
            total, count = accelerator.reduce(sums, reduction="sum").tolist()
            out["rollout/logprob_diff"] = total / max(count, 1.0)
        return out


def sft_pass(accelerator, actor, rows: dict | None, coef: float, autocast, ds: bool, oom, done: "Stats") -> None:
    """The SFT mix (sft_files, PPO-ptx): one pass of supervised data in every mini-batch, on every
    rank, added to the mini-batch's gradient; its forward and its backward each in their own agreed
    block. rows: drawn once per mini-batch, outside the retried unit, so a redo trains on them."""
    if rows is None:
        return
    with oom.agreed("actor"):
        nll = sft_loss(accelerator, actor, rows, autocast)
    with oom.agreed("actor"):
        backward(actor, coef * nll, ds)
    done.add({"actor/sft_loss": nll.item()})


def sft_loss(accelerator, actor, batch: dict, autocast) -> torch.Tensor:
    """Next-token NLL of one SFT micro-batch, normalised by the response tokens of all ranks (the
    gradient average over ranks then gives the mean over every rank's tokens)."""
    batch = to_device(batch, accelerator.device)
    mask = batch["response_mask"]                                                  # [s, R]
    tokens = accelerator.reduce(mask.sum(), reduction="sum") / accelerator.num_processes
    with autocast():
        logprob, _ = response_logprobs(actor, batch, 1.0)                         # [s, R]
    return -(logprob * mask).sum() / tokens


def update_critic(accelerator, critic, optim, batch: dict, cfg: Config, autocast, ds: bool, *, oom) -> dict:
    """ppo_epochs x mini-batches x micro-batches, one optimizer step per mini-batch: each
    micro-batch's values, verl's clipped value loss, backward. Beside it, the one reaction the critic
    has: the OOM reaction (the mini-batch redone with smaller micro-batches, its gradients dropped)."""
    stats = Stats()
    sched = schedule(cfg, "critic")
    mini = sched.mini_batch * cfg.rollout_n // ulysses.data_parallel(accelerator)[0]   # per data-parallel rank
    agree = max_over_ranks(accelerator)

    def mini_batch(mb: dict) -> Stats:
        done = Stats()   # this try's figures: a try that runs out of memory leaves none
        norms = mini_batch_norms(accelerator, mb["response_mask"], cfg)
        vf_total = 0.0
        for _, micro in micro_batches(mb, *oom.size("critic"), agree):
            with oom.agreed("critic"):   # forward and loss: every rank agrees before any backward
                with autocast():
                    vpreds = critic_values(critic, micro)
                vf, clipfrac = value_loss(vpreds, micro["returns"], micro["values"], micro["response_mask"],
                                          cfg.cliprange_value, cfg.loss_agg_mode, **norms)
            with oom.agreed("critic"):
                backward(critic, vf, ds)
            vf_total += vf.item()
            done.add({"critic/vf_clipfrac": clipfrac.item(),
                      "critic/vpred_mean": masked_mean(vpreds.detach(), micro["response_mask"]).item()})
        grad_norm, skipped = optimizer_step(critic, optim, cfg.critic_max_grad_norm, ds)
        done.add({"critic/vf_loss": vf_total, "critic/grad_norm": grad_norm if not skipped else float("nan")})
        return done

    for _ in range(sched.epochs):
        for mb in mini_batches(batch, mini):
            stats.merge(oom.retry("critic", lambda: mini_batch(mb), lambda: drop_gradients(critic, optim, ds)))
    grad_blocks.release()   # not held through the actor's update
    return stats.means()


class Stats:
    """Collects a step's metric values; each metric is the mean over everything recorded."""

    def __init__(self):
        self.values: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}
        self.totals: dict[str, float] = {}   # sums, for a mean the caller weighs itself

    def add(self, metrics: dict):
        # a NaN (e.g. the norm of a skipped step) is kept so the key is: under several processes every
        # rank must reduce the same keys, whatever its data
        for k, v in metrics.items():
            self.values.setdefault(k, []).append(float(v))

    def merge(self, other: "Stats"):
        for k, v in other.values.items():
            self.values.setdefault(k, []).extend(v)
        for k, n in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + n
        for k, x in other.totals.items():
            self.totals[k] = self.totals.get(k, 0.0) + x

    def count(self, key: str, hit: bool):
        self.counts[key] = self.counts.get(key, 0) + int(hit)

    def total(self, key: str, value):
        self.totals[key] = self.totals.get(key, 0.0) + float(value)

    def means(self) -> dict:
        """Each metric's mean over its non-NaN values; NaN if it had none."""
        out = {}
        for k, v in self.values.items():
            kept = [x for x in v if not math.isnan(x)]
            out[k] = sum(kept) / len(kept) if kept else float("nan")
        out.update(self.counts)
        return out


@contextmanager
def timed(times: dict, name: str):
    """The block's seconds into times[time/<name>_s] (added up), its peak memory into
    times[perf/peak_rss_gb/<name>] (and perf/peak_cuda_gb/<name> on CUDA; the larger)."""
    start = time.perf_counter()
    with host_memory.PEAKS.phase(name, times):
        yield
    times[f"time/{name}_s"] = times.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


def seconds(times: dict) -> dict:
    """timed()'s phase seconds, without the memory peaks it records beside them."""
    return {k: v for k, v in times.items() if k.startswith("time/")}


# ----------------------------------------------------------------------------------------------
# Rewards, validation, the main loop.
# ----------------------------------------------------------------------------------------------
def compute_advantages(cfg: Config, token_rewards, values, mask, group_ids, valid):
    if cfg.adv_estimator == "gae":
        return compute_gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.adv_estimator == "grpo":
        return compute_grpo_advantages(token_rewards, mask, group_ids, cfg.norm_adv_by_std_in_grpo, valid=valid)
    if cfg.adv_estimator == "rloo":
        return compute_rloo_advantages(token_rewards, mask, group_ids, valid)
    if cfg.adv_estimator == "reinforce_plus_plus":
        return compute_reinforce_pp_advantages(token_rewards, mask, cfg.gamma)
    return compute_reinforce_pp_baseline_advantages(token_rewards, mask, group_ids, valid)


def validation_share(n: int, world: int, rank: int) -> tuple[list[int], int]:
    """This rank's validation prompts -> (indices, how many of them count). Every rank gets
    ceil(n / world) prompts, so all run the same number of passes (under ZeRO-3 a rank with fewer
    would hang the others); the ranks short of prompts repeat prompt 0, which does not count."""
    mine = list(range(rank, n, world))
    share = -(-n // world)
    return mine + [0] * (share - len(mine)), len(mine)


def validation_rounds(share: int, val_batch_size: int | None, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each round over a rank's share of the validation prompts: val_batch_size
    prompts a round over all ranks (a global size, as train_batch_size), so ceil(val_batch_size /
    world) of a rank's; None or 0: one round. Every share has the same size (validation_share), so
    every rank runs the same rounds: the same generate and scoring calls."""
    per = -(-val_batch_size // world) if val_batch_size else max(share, 1)
    return [(start, min(start + per, share)) for start in range(0, share, per)]


def run_validation(cfg, accelerator, engine, scorer, tokenizer, val: PromptSet, tools=None) -> tuple[dict, dict]:
    """Greedy (by default) generation on this rank's share of the validation prompts, in rounds of
    val_batch_size; scores are summed over ranks, so the figures cover the whole validation set."""
    world, rank = ulysses.data_parallel(accelerator)
    idx, real = validation_share(len(val.ids), world, rank)
    mine = val.take(idx)
    params = SamplingParams(n=1, temperature=cfg.val_temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_tokens=cfg.max_response_length)
    rounds = validation_rounds(len(idx), cfg.val_batch_size, world)
    # the rounds sample what one call would: the call's seed, each prompt's draws keyed to its place in
    # the share (not kept with tools, whose passes draw afresh, nor across a tensor-parallel vLLM group)
    keyed = len(rounds) > 1 and not tools and cfg.rollout_tensor_model_parallel_size == 1
    if keyed:
        params = dataclasses.replace(params, seed=engine.draw_seed(params, len(idx)))
    kept = {"scores": [], "texts": [], "responses": [], "unreadable": [], "verdicts": []}
    for start, stop in rounds:
        part = mine.take(range(start, stop))
        # an SP group's ranks sample a share each and all score the group's batch (a split reward-model pass)
        out = generate_split(engine, part, params, tools, any_over_ranks(accelerator),
                             (start, len(idx)) if keyed else None)
        batch = to_device(out.batch(tokenizer.pad_token_id) if tools else
                          pack_batch(part.ids, out.responses, tokenizer.pad_token_id), accelerator.device)
        micro, budget = reward_micro_batch(cfg)
        scores = scorer(part, out.responses, batch, micro, getattr(out, "columns", None), max_tokens=budget,
                        agree=max_over_ranks(accelerator)).to(accelerator.device)
        count = max(0, min(real, stop) - start)   # the round's prompts that are this rank's own
        kept["scores"].append(scores[:count])
        kept["texts"] += part.texts[:count]
        kept["responses"] += out.responses[:count]
        if scorer.judge is not None:
            kept["unreadable"] += scorer.unreadable[:count]
            kept["verdicts"] += scorer.verdicts[:count]
    scorer.take_judge_errors()   # validation's own count: not the next training step's
    scores, texts, responses = torch.cat(kept["scores"]), kept["texts"], kept["responses"]
    sums = torch.tensor([scores.sum().item(), (scores >= 1.0).float().sum().item(), float(len(scores)),
                         float(sum(kept["unreadable"]))], dtype=torch.float64, device=scores.device)
    total, correct, count, unreadable = accelerator.reduce(sums, reduction="sum").tolist()
    metrics = {"val/score_mean": total / count}
    if scorer.is_verifier:
        metrics["val/accuracy"] = correct / count
    n = min(cfg.log_samples, len(texts))
    samples = {"prompt": texts[:n], "response": tokenizer.batch_decode(responses[:n], skip_special_tokens=True),
               "score": scores[:n].tolist()}
    if scorer.judge is not None:   # the judge's raw verdicts beside the responses they scored
        metrics["val/judge_parse_errors"] = unreadable
        samples["judge"] = kept["verdicts"][:n]
    return metrics, samples


def rewards_and_advantages(cfg, accelerator, kl_ctrl, batch, token_scores, group_ids, valid) -> dict:
    """Phase 4 on the whole batch (gathered from all ranks): KL in the reward, the controller
    update, advantages with whitening over every valid token of the step; returns this rank's rows.
    N ranks x B/N prompts thus give the statistics of 1 rank x B prompts (gather_rows takes one
    rank of each sequence-parallel group)."""
    rows, R = token_scores.shape
    start = ulysses.data_parallel(accelerator)[1] * rows
    full = {k: gather_rows(accelerator, v) for k, v in
            {"scores": token_scores, "mask": batch["response_mask"], "old": batch["old_logprob"],
             "ref": batch.get("ref_logprob", batch["old_logprob"]),
             "values": batch.get("values", torch.zeros_like(token_scores)),
             **({"entropy": batch["old_entropy"]} if "old_entropy" in batch else {})}.items()}   # none in bypass mode
    metrics = {}
    beta = kl_ctrl.value   # read before the update, as verl does
    token_rewards = full["scores"]
    if "ref_logprob" in batch:
        shaped, current_kl = kl_in_reward(full["scores"], full["old"], full["ref"], full["mask"],
                                          beta if cfg.use_kl_in_reward else 0.0, cfg.kl_penalty)
        if cfg.use_kl_in_reward:
            token_rewards = shaped
            kl_ctrl.update(current_kl.item(), n_steps=full["scores"].shape[0])
        metrics = {"kl/mean": current_kl.item(), "kl/coef": beta if cfg.use_kl_in_reward else 0.0}
    if "entropy" in full:   # verl's actor/entropy: the old-log-prob pass's, whole batch, aggregated as the loss is
        metrics["actor/entropy"] = agg_loss(full["entropy"], full["mask"], cfg.loss_agg_mode,
                                            seq_len=cfg.max_response_length).item()
    all_valid = gather_rows(accelerator, valid.float()) > 0                                       # [B]
    adv, returns = compute_advantages(cfg, token_rewards, full["values"], full["mask"], group_ids, all_valid)
    if cfg.adv_estimator == "gae":
        metrics["critic/explained_var"] = explained_variance(returns, full["values"], full["mask"]).item()
    batch["advantages"] = adv[start:start + rows, :R]
    batch["returns"] = returns[start:start + rows, :R]
    return metrics


@dataclass
class Run:
    """Everything one training run holds, built by setup()."""
    cfg: Config
    accelerator: typing.Any
    ds: bool                        # DeepSpeed engines (else plain modules)
    tokenizer: typing.Any
    actor: typing.Any
    critic: typing.Any              # None for critic-free estimators
    ref: typing.Any                 # None without KL
    trained: dict                   # name -> (model, optimizer, lr scheduler)
    engine: typing.Any              # the rollout engine
    scorer: Scorer
    kl_ctrl: typing.Any
    train: PromptSet
    val: PromptSet | None
    stream: PromptStream
    sft: SFTStream | None           # the SFT mix's rows (sft_files)
    guards: Guards
    tracker: Tracker
    autocast: typing.Any
    first_step: int = 1
    total_steps: int = 0            # the run's length: total_training_steps, or counted from total_epochs
    resumed: dict | None = None
    engine_state: dict | None = None   # the rollout engine's state from a checkpoint
    hf: typing.Any = None              # the actor as a sampler, for rollout_on_drift=regenerate
    parked: typing.Any = None          # a vLLM engine that started while another rank's did not: asleep, unused
    shapes: dict = field(default_factory=dict)   # role -> flops.Shape, for perf/mfu
    peak_flops: float = 0.0                      # the device's peak FLOP/s; 0 = unknown, no perf/mfu
    tools: typing.Any = None                     # multi-turn rollouts (tools / environment), else None
    oom: typing.Any = None                       # the OOM reaction and the micro-batch sizes in use (oom.py)
    rollouts: typing.Any = None                  # one_step_off/async: the rollout side (rollout/asynchronous.py)
    in_flight: dict | None = None                # its batches generated ahead, from a checkpoint


def hf_engine(run: Run):
    """The hf engine on the actor (built on first use), to sample a step on-policy."""
    if run.hf is None:
        run.hf = make_engine(run.cfg, _unwrap(run.actor), run.tokenizer,
                             [gathered_params(run.actor, run.ds), run.autocast], run.accelerator.num_processes,
                             run.accelerator.process_index, kind="hf")
    return run.hf


def setup(cfg: Config) -> Run:
    """Accelerator, models (DeepSpeed engines under DeepSpeed), data, rollout engine, tracking; a
    checkpoint to resume from is found and checked before any model loads, and loaded after."""
    lean_imports.skip_unused()   # before Accelerate imports DeepSpeed (load_models repeats it for direct callers)
    host_memory.set_malloc(cfg.malloc_mmap_threshold_mb)   # before the models' tensors exist
    import yaml
    from accelerate.utils import set_seed

    accelerator, ds = make_accelerator(cfg)
    world = accelerator.num_processes
    check_world_size(cfg, world)
    ulysses.setup(cfg.ulysses_sequence_parallel_size)   # the sequence-parallel groups, before any model
    dp, dp_rank = ulysses.data_parallel(accelerator)
    if accelerator.is_main_process:
        for note in config_warnings(cfg):
            print(f"warning: {note}", file=sys.stderr, flush=True)
    ckpt = find_checkpoint(cfg.resume, cfg.output_dir)
    resumed = read_state(ckpt) if ckpt else None
    if resumed:
        for note in check_resumable(dataclasses.asdict(cfg), resumed, ckpt):
            if accelerator.is_main_process:
                print(f"resume: {note}", flush=True)
    set_seed(cfg.seed)          # the same initialisation (e.g. the value head) on every rank
    out_dir = Path(cfg.output_dir)
    if accelerator.is_main_process:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        except OSError as e:
            raise UserError(f"output_dir {out_dir} cannot be written: {e.strerror or e}") from None
    autocast = accelerator.autocast if cfg.dtype == "bf16" and not ds else nullcontext

    tokenizer, actor, critic, ref, reward_model = load_models(cfg)
    tools = make_tool_rollouts(cfg, tokenizer)   # multi-turn: refuses a chat template that is not prefix-preserving
    sandbox_tags, sandbox_warnings = tools.sandbox_notes() if tools else ({}, [])   # how the python tool runs code
    if accelerator.is_main_process:
        for note in sandbox_warnings:
            print(f"warning: {note}", file=sys.stderr, flush=True)
    scorer = Scorer(cfg, tokenizer, None)
    read = lambda files: load_prompts(files, cfg.prompt_key, tokenizer, cfg.max_prompt_length,   # noqa: E731
                                      cfg.prompt_truncation, scorer.dataset_columns(TRAJECTORY_COLUMNS if tools else ()),
                                      scorer.source, keep_rows=tools is not None,
                                      template_kwargs=cfg.chat_template_kwargs)
    train, val = read(cfg.train_files), (read(cfg.val_files) if cfg.val_files else None)
    steps = total_steps(cfg, len(train.ids))
    sft = SFTStream(load_sft(cfg, tokenizer), sft_batch_size(cfg, dp), cfg.seed, dp_rank, dp,
                    tokenizer.pad_token_id) if cfg.sft_files else None
    (actor, actor_optim, actor_sched, critic, critic_optim, critic_sched, ref,
     scorer.reward_model) = prepare_models(accelerator, ds, cfg, actor, critic, ref, reward_model, steps)
    set_seed(cfg.seed + dp_rank)   # each data-parallel rank samples differently; data order uses cfg.seed alone
    trained = {"actor": (actor, actor_optim, actor_sched)}
    if critic is not None:
        trained["critic"] = (critic, critic_optim, critic_sched)
    run = Run(cfg, accelerator, ds, tokenizer, actor, critic, ref, trained, None, scorer,
              kl.make_kl_controller(cfg.kl_ctrl_type, cfg.kl_coef, cfg.target_kl, cfg.kl_horizon),
              train, val, PromptStream(len(train.ids), cfg.train_batch_size, cfg.seed), sft, Guards(cfg), None,
              autocast, total_steps=steps)
    run.tools = tools
    run.oom = OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries)
    if resumed:
        restore(run, ckpt, resumed)
        rescale_lr(*run.trained["actor"][1:], resumed_lr_scale(cfg.actor_lr, resumed))   # e.g. a guard's advice
        if accelerator.is_main_process:
            print(f"resuming from {ckpt} (step {resumed['step']})", flush=True)
    run.resumed = resumed
    run.shapes = {role: flops.shape_of(_unwrap(m)) for role, m in
                  (("actor", actor), ("ref", ref), ("critic", critic), ("reward", scorer.reward_model)) if m is not None}
    # the lowest over ranks (a collective every rank runs here), so that with GPUs of different
    # kinds every rank logs perf/mfu or none does: the step's metrics are reduced as one tensor
    peak = torch.tensor([flops.peak(accelerator.device, cfg.dtype == "bf16", cfg.peak_tflops)], device=accelerator.device)
    run.peak_flops = float(accelerator.gather(peak).min())
    scorer.start(world, accelerator.process_index, accelerator.device)   # a judge's or served reward model's engine
    start_engine(run)
    if cfg.rollout_mode != "colocated":   # generation in its own loop; the RNG as colocated leaves it (seeds drawn from it)
        with torch.random.fork_rng(devices=[]):
            run.rollouts = RolloutSide(cfg, train.ids, run.stream, tokenizer.eos_token_id, tokenizer.pad_token_id, steps,
                                       accelerator.process_index, accelerator.num_processes)
        run.rollouts.load_state_dict(run.in_flight)
        run.rollouts.send(run.first_step - 1, actor_weights(actor, ds, cfg.rollout_sync_bucket_mb))
    tags = run_tags(world, distributed.zero_stage(accelerator), run.engine.name, HERE) | sandbox_tags
    run.tracker = Tracker(out_dir, accelerator.is_main_process, uri=cfg.mlflow_tracking_uri,
                          experiment=cfg.mlflow_experiment, run_name=cfg.run_name, params=dataclasses.asdict(cfg),
                          tags=tags, system_metrics=cfg.mlflow_system_metrics, resumed=resumed,
                          log_model=cfg.mlflow_log_model, registered_model_name=cfg.mlflow_registered_model_name,
                          close_timeout_s=cfg.mlflow_close_timeout_s, wandb=cfg.wandb,
                          datasets={"training": _split_files(cfg.train_files), "validation": _split_files(cfg.val_files),
                                    "sft": _split_files(cfg.sft_files)})
    host_memory.release_code_pages()   # the libraries' pages that imports and setup read, out of the resident set
    return run


def start_engine(run: Run) -> None:
    """The rollout engine, with the actor's weights (and a resumed engine's state): vLLM on every rank
    or on none."""
    cfg, accelerator, actor, ds = run.cfg, run.accelerator, run.actor, run.ds
    tokenizer, autocast = run.tokenizer, run.autocast
    world, rank = accelerator.num_processes, accelerator.process_index
    # the asynchronous modes sample on their rollout side: here the hf engine, for validation
    run.engine = make_engine(cfg, _unwrap(actor), tokenizer, [gathered_params(actor, ds), autocast],
                             world, rank, kind="hf" if cfg.rollout_mode != "colocated" else "")
    if cfg.rollout_engine == "vllm" and world > 1:
        # rollout_fallback_hf: all ranks fall back together, or the vLLM ranks would wait in the
        # weight sync's ZeRO-3 gathers for a rank that never joins them
        started = accelerator.gather(torch.tensor([float(run.engine.name == "vllm")], device=accelerator.device))
        if not started.all() and run.engine.name == "vllm":
            print(f"warning: rank {rank}: vLLM started here but not on every rank: all ranks generate with the hf "
                  "engine (rollout_fallback_hf)", file=sys.stderr, flush=True)
            run.engine.sleep()   # kept, not shut down: vLLM's teardown destroys the process group
            run.parked, run.engine = run.engine, make_engine(cfg, _unwrap(actor), tokenizer,
                                                             [gathered_params(actor, ds), autocast], world, rank,
                                                             kind="hf")
    run.engine.load_weights(actor_weights(actor, ds, cfg.rollout_sync_bucket_mb))   # e.g. a resumed actor
    if run.resumed:
        run.engine.load_state_dict(run.engine_state)


def restore(run: Run, path: Path, state: dict) -> None:
    """A checkpoint's models, optimizers, schedules, RNGs, KL controller and data position."""
    mine = load_checkpoint(run.accelerator, run.ds, path, state, run.trained)
    run.engine_state = mine.get("engine", {})   # the sampler's seed counter: a resumed run samples the same
    run.in_flight = mine.get("in_flight")       # the asynchronous modes' batches generated ahead
    if run.engine is not None:
        run.engine.load_state_dict(run.engine_state)
    run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    run.stream.epoch, run.stream.pos = state["data"]["epoch"], state["data"]["pos"]
    run.guards.entropy_reaction = state.get("entropy_reaction", False)
    run.guards.rollbacks = max(run.guards.rollbacks, state.get("rollbacks", 0))
    run.guards.load_state_dict(state.get("guards"))
    run.oom.load_state_dict(state.get("oom"))
    if run.sft is not None and state.get("sft_data"):
        run.sft.rows.epoch, run.sft.rows.pos = state["sft_data"]["epoch"], state["sft_data"]["pos"]
    run.first_step = state["step"] + 1


@dataclass
class Rollouts:
    """One step's samples on this rank, scored, with the no-grad forward passes done."""
    batch: dict                     # pack_batch's tensors + old_logprob, ref_logprob, values, is_weights
    responses: list[list[int]]
    scores: torch.Tensor            # [b] the reward's score per sequence (0 where non-finite)
    nonfinite: torch.Tensor         # [b] bool: dropped from the update (skip_nonfinite_rewards)
    truncated: torch.Tensor         # [b] bool: cut at max_response_length without EOS
    token_scores: torch.Tensor      # [b, R] the shaped score placed over the response tokens (reward_placement)
    sampler: torch.Tensor           # [b, R] the sampler's log-probs, of the distribution it drew from
    actor_sampling: torch.Tensor | None   # [b, R] the actor's under that distribution (old_logprob unless top_k/top_p
                                          # cut); None in bypass mode (no actor pass)
    is_stats: dict
    tool_stats: dict = field(default_factory=dict)   # tools/* and time/tools_s (multi-turn)


def sampling_params(cfg: Config, temperature: float) -> SamplingParams:
    return SamplingParams(n=cfg.rollout_n, temperature=temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_response_length, ignore_eos=cfg.rollout_ignore_eos)


def sample(run: Run, idx: list[int], engine, temperature: float, times: dict, again: bool = False,
           rollout=None) -> Sampled:
    """Phases 1-2 on this rank's prompts idx, up to the raw scores: rollout_n responses per prompt,
    prompt-major order. again: dynamic sampling's next round, on an engine that slept after the
    last one (sleep level 2 dropped the weights: sent again). rollout: generated already (the
    asynchronous modes' rollout side): scored only."""
    cfg, device = run.cfg, run.accelerator.device
    prompts = run.train.take(idx, cfg.rollout_n)                                  # one row per response
    with timed(times, "gen"):
        if again:
            if cfg.rollout_sleep_level == 2:
                engine.wake_up(["weights"])
                engine.load_weights(actor_weights(run.actor, run.ds, cfg.rollout_sync_bucket_mb))
            engine.wake_up()
        # each rank of a sequence-parallel group samples a share; multi-turn: one trajectory per prompt
        # and sample (prompts repeated rollout_n times), every rank as many passes
        if rollout is None:
            rollout = generate_split(engine, prompts if run.tools else run.train.take(idx),
                                     sampling_params(cfg, temperature), run.tools, any_over_ranks(run.accelerator))
            engine.sleep()   # vLLM on GPU: weights and KV cache leave the GPU while the models train
    with timed(times, "score"):
        # multi-turn: response_mask is 0 at tool tokens (no policy loss, KL, entropy, value or advantage)
        batch = to_device(rollout.batch(run.tokenizer.pad_token_id) if run.tools else
                          pack_batch(prompts.ids, rollout.responses, run.tokenizer.pad_token_id), device)
        micro, budget = reward_micro_batch(cfg)
        with host_memory.frozen_pass(run.scorer.reward_model):   # its weights resident one layer at a time
            scores = run.scorer(prompts, rollout.responses, batch, micro, getattr(rollout, "columns", None),
                                max_tokens=budget, agree=max_over_ranks(run.accelerator)).to(device)
    return Sampled(idx, rollout.responses, rollout.logprobs, scores, rollout if run.tools else None)


def collect(run: Run, idx: list[int], engine, temperature: float, times: dict,
            sampled: Sampled | None = None) -> Rollouts:
    """Phases 1-3 on this rank's prompts idx (or on the groups dynamic sampling kept): generate,
    score, forward passes."""
    cfg, tokenizer, device = run.cfg, run.tokenizer, run.accelerator.device

    # 1 generate: rollout_n responses per prompt, prompt-major order (and their raw scores)
    if sampled is None:
        sampled = sample(run, idx, engine, temperature, times)
    tools = sampled.tools   # the multi-turn trajectories, or None
    with timed(times, "gen"):
        prompts = run.train.take(sampled.idx, cfg.rollout_n)                       # one row per response
        batch = to_device(tools.batch(tokenizer.pad_token_id) if tools else
                          pack_batch(prompts.ids, sampled.responses, tokenizer.pad_token_id), device)
        mask = batch["response_mask"]                                                          # [b, R]

    # 2 score: one score per sequence, shaped, placed over its response tokens
    with timed(times, "score"):
        scores = sampled.scores                                                                # [b]
        nonfinite = ~torch.isfinite(scores)                     # only with skip_nonfinite_rewards
        if nonfinite.any():   # those samples take no part in the update
            scores, mask[nonfinite] = torch.where(nonfinite, 0.0, scores), 0.0
        truncated = tools.truncated if tools else is_truncated(sampled.responses, tokenizer.eos_token_id,
                                                               cfg.max_response_length)
        bonus = tools.bonus(cfg.tool_call_bonus) if tools and cfg.tool_call_bonus else None
        shaped = shape_scores(cfg, scores, sampled.responses, truncated.to(device), ~nonfinite, bonus)   # [b]
        token_scores = place_scores(shaped, mask, cfg.reward_placement, cfg.reward_decay)

    # 3 forward passes, no grad: old log-probs (actor), ref log-probs, values (critic); an OOM redoes them
    with timed(times, "forward"), run.autocast():
        reported = None if sampled.logprobs is None else sampler_logprobs(sampled.logprobs, mask)
        if cfg.rollout_bypass_mode:   # verl's bypass mode: the sampler's log-probs are the old ones, no actor pass
            if reported is None:
                raise UserError("rollout_bypass_mode=true needs the sampler's log-probs, and this rollout reported "
                                "none: set rollout_bypass_mode=false")
            batch["old_logprob"] = reported
        actor_sampling = run.oom.retry("log_prob", lambda: forward_passes(run, batch, temperature))
        # both engines report them (an engine that did not would count as the actor itself)
        sampler = actor_sampling if reported is None else reported
        is_stats = {}
        if cfg.rollout_is != "off":   # sampler against actor under one distribution: see docs/configuration.md on top_p/top_k
            batch["is_weights"], is_stats = rollout_is_weights(actor_sampling, sampler, mask, cfg.rollout_is,
                                                               cfg.rollout_is_threshold)
    return Rollouts(batch, sampled.responses, scores, nonfinite, truncated, token_scores, sampler, actor_sampling,
                    is_stats, tools.metrics() if tools else {})


def forward_passes(run: Run, batch: dict, temperature: float) -> torch.Tensor | None:
    """Phase 3 on this rank's rollouts: old_logprob, ref_logprob and values into batch -> the actor's
    log-probs under the sampler's distribution (None in bypass mode: old_logprob is the sampler's,
    and the actor's pass is skipped). Each micro-batch's pass is agreed on by every rank (an OOM on
    one raises PhaseOOM on all, after the pass: oom.py)."""
    cfg, accelerator = run.cfg, run.accelerator

    def agreed(fn):
        def guarded(mb):
            with run.oom.agreed("log_prob"):
                return fn(mb)
        return guarded

    logprobs_of = lambda model: lambda mb: response_logprobs(model, mb, temperature)[0]   # noqa: E731
    critic_sched = schedule(cfg, "critic")
    micro, max_tokens = run.oom.size("log_prob")
    passes = dict(size=micro, max_tokens=max_tokens, agree=max_over_ranks(accelerator))
    truncation = (cfg.top_k, cfg.top_p) if sampling_cut(cfg) else None

    def actor_pass(mb):
        """-> [b, r, 2 or 3]: the old log-probs, their entropy (actor/entropy, as verl measures it)
        and, where the samplers report log-probs of a cut distribution (top_k / top_p), the actor's
        of the same, from one pass."""
        return torch.stack(response_logprobs(run.actor, mb, temperature, with_entropy=True, truncation=truncation), dim=-1)
    actor_sampling = None
    if not cfg.rollout_bypass_mode:
        outs = forward_in_micro_batches(agreed(actor_pass), batch, **passes)             # [b, R, 2 or 3]
        batch["old_logprob"], batch["old_entropy"] = outs[..., 0].contiguous(), outs[..., 1].contiguous()
        actor_sampling = batch["old_logprob"] if truncation is None else outs[..., 2].contiguous()
    ref_sched = schedule(cfg, "ref")   # its own sizes (ref_log_prob_*), shrunk as the phase's on an OOM
    size, budget = run.oom.scaled("log_prob", ref_sched.micro_batch, ref_sched.max_tokens)
    ref_passes = dict(passes, size=size, max_tokens=budget)
    if run.ref is not None:
        with host_memory.frozen_pass(run.ref):   # its file-mapped weights resident one layer at a time
            batch["ref_logprob"] = forward_in_micro_batches(agreed(logprobs_of(run.ref)), batch, **ref_passes)
    elif cfg.lora_rank and (cfg.use_kl_in_reward or cfg.use_kl_loss):
        with _unwrap(run.actor).disable_adapter():   # the base model is the reference
            batch["ref_logprob"] = forward_in_micro_batches(agreed(logprobs_of(run.actor)), batch, **ref_passes)
    if run.critic is not None:
        size, budget = run.oom.scaled("log_prob", critic_sched.micro_batch, critic_sched.max_tokens)
        batch["values"] = forward_in_micro_batches(agreed(lambda mb: critic_values(run.critic, mb)), batch, size=size,
                                                   max_tokens=budget, agree=passes["agree"])
    return actor_sampling


def sampler_drift(accelerator, data: Rollouts) -> float:
    """rollout/logprob_diff: the mean |sampler - actor| log-prob over every rank's response tokens,
    both under the distribution the sampler drew from (with top_k/top_p: cut and renormalised), so
    it measures the weights and kernels, not the truncation."""
    mask = data.batch["response_mask"]
    sums = torch.stack([((data.sampler - data.actor_sampling).abs() * mask).sum(), mask.sum()]).double()
    total, count = accelerator.reduce(sums, reduction="sum").tolist()
    return total / max(count, 1.0)


def warn_fresh_mismatch(run: Run, step: int, drift: float) -> None:
    """On the first step, where the engine's weights were just copied from the actor: a drift that
    only a sampler computing the model differently explains is named (rollout/engines.py)."""
    mismatch = step == run.first_step and fresh_mismatch_warning(
        drift, run.engine.name, run.cfg.dtype, _unwrap(run.actor).config.model_type)
    if mismatch and run.accelerator.is_main_process:
        print(mismatch, file=sys.stderr, flush=True)


def check_drift(run: Run, step: int, idx: list[int], data: Rollouts, temperature: float,
                times: dict) -> tuple[Rollouts, float | None, bool]:
    """rollout/logprob_diff over rollout_max_logprob_diff: stop, or sample the step again on the actor
    -> (the rollouts, the drift (None in bypass mode), whether they were regenerated)."""
    cfg, accelerator = run.cfg, run.accelerator
    if cfg.rollout_bypass_mode:   # no actor pass to compare with: the update measures rollout/logprob_diff
        return data, None, False
    # every engine reports its log-probs, so every rank runs this collective whatever engine it got
    drift = sampler_drift(accelerator, data)
    warn_fresh_mismatch(run, step, drift)
    if cfg.rollout_max_logprob_diff > 0 and drift > cfg.rollout_max_logprob_diff:
        if cfg.rollout_on_drift == "stop":
            raise UserError(f"step {step}: rollout/logprob_diff={drift:.4g} > rollout_max_logprob_diff="
                            f"{cfg.rollout_max_logprob_diff}: the sampler's weights no longer match the actor's (set "
                            f"rollout_on_drift=regenerate or raise rollout_max_logprob_diff, and resume with the same "
                            f"command and that change)")
        # regenerate: sample this step on-policy with the actor while vLLM sleeps (on a GPU its
        # memory stays free for the hf engine and the update); phase 6 re-sends every weight anyway
        if accelerator.is_main_process:
            print(f"warning: step {step}: rollout/logprob_diff={drift:.4g} > rollout_max_logprob_diff="
                  f"{cfg.rollout_max_logprob_diff}: step regenerated with the hf engine, weights re-sent after "
                  "the update", file=sys.stderr, flush=True)
        return collect(run, idx, hf_engine(run), temperature, times), drift, True
    return data, drift, False


def rollout_metrics(run: Run, data: Rollouts, batch: dict, drift: float, regenerated: bool,
                    temperature: float) -> dict:
    """Phase 7's figures of this rank's rollouts and of the guards' state (reduced over ranks with
    the update's). batch: what the update saw (PF-PPO redraws it)."""
    cfg, scores, mask = run.cfg, data.scores, data.batch["response_mask"]
    metrics = {
        "reward/score_mean": scores.mean().item(),
        "reward/score_std": scores.std().item() if len(scores) > 1 else 0.0,
        "reward/score_median": median_over_ranks(run.accelerator, scores),
        "rollout/response_len_mean": mask.sum(-1).mean().item(),
        "rollout/truncated_frac": data.truncated.float().mean().item(),
        # the mean over ranks makes it a sum over the data-parallel ranks (an SP group holds one batch)
        "perf/tokens": batch["attention_mask"].sum().item() * ulysses.data_parallel(run.accelerator)[0],
    }
    if drift is not None:   # bypass mode: the update measured it
        metrics["rollout/logprob_diff"] = drift
    if run.scorer.is_verifier:
        metrics["reward/accuracy"] = (scores >= 1.0).float().mean().item()
    if run.scorer.judge is not None:   # the mean over ranks makes it a sum over the data-parallel ranks
        metrics["reward/judge_parse_errors"] = run.scorer.take_judge_errors() * ulysses.data_parallel(run.accelerator)[0]
    if cfg.entropy_floor:
        metrics.update({"guard/entropy_reaction": float(run.guards.entropy_reaction),
                        "guard/temperature": temperature, "guard/entropy_coeff": run.guards.entropy_coeff})
    if cfg.nan_clip_reaction:
        metrics.update({"guard/nan_clip_reaction": float(run.guards.nan_clip),
                        "guard/max_grad_norm": run.guards.max_grad_norm})
    if cfg.max_oom_retries:
        metrics.update(run.oom.metrics())
    if cfg.skip_nonfinite_rewards:
        metrics["reward/nonfinite_frac"] = data.nonfinite.float().mean().item()
    if cfg.rollout_on_drift == "regenerate":
        metrics["rollout/regenerated"] = float(regenerated)
    metrics.update({f"rollout_is/{k}": v.item() for k, v in data.is_stats.items()})
    metrics.update(data.tool_stats)   # time/tools_s: part of time/gen_s
    return metrics


def train_step(run: Run, step: int) -> dict:
    """One PPO iteration on this rank's share of the prompt batch -> the step's metrics, reduced
    over ranks, with the time of each phase."""
    cfg, accelerator, engine = run.cfg, run.accelerator, run.engine
    device, world = accelerator.device, accelerator.num_processes
    dp, dp_rank = ulysses.data_parallel(accelerator)   # a sequence-parallel group is one data-parallel rank
    times: dict = {}
    step_start = time.perf_counter()
    temperature = run.guards.temperature   # entropy_floor may have changed it
    run.oom.start_step(step)
    per_rank = cfg.train_batch_size // dp
    share = lambda: run.stream.next()[dp_rank * per_rank:][:per_rank]   # noqa: E731
    idx = share() if run.rollouts is None else None                              # this rank's prompts
    group_ids = torch.arange(cfg.train_batch_size, device=device).repeat_interleave(cfg.rollout_n)  # [B] all ranks

    # 1-3 generate, score, forward passes
    sampled, filtered = None, {}
    if run.rollouts is not None:   # 1 one_step_off/async: the batch generated ahead, up to max_staleness versions old
        with timed(times, "wait_rollout"):
            idx, rollout, filtered = run.rollouts.take(step, sampling_params(cfg, temperature))
        sampled = sample(run, idx, engine, temperature, times, rollout=rollout)
    elif cfg.filter_groups_enable:   # DAPO: rounds of prompts until every rank holds its share of groups that vary
        sampled, filtered = fill_groups(idx, share, lambda i, again: sample(run, i, engine, temperature, times, again),
                                        lambda part: group_metric(cfg, part, run.tokenizer.eos_token_id,
                                                                  run.scorer.is_verifier),
                                        min_over_ranks(accelerator), per_rank, cfg.rollout_n, cfg.max_num_gen_batches,
                                        step)
        idx = sampled.idx
    data = collect(run, idx, engine, temperature, times, sampled)
    data, drift, regenerated = check_drift(run, step, idx, data, temperature, times)
    batch, valid, token_scores = data.batch, ~data.nonfinite, data.token_scores

    # 4 rewards and advantages over the whole batch (timed with the forward passes: it is tiny)
    with timed(times, "forward"):
        metrics = rewards_and_advantages(cfg, accelerator, run.kl_ctrl, batch, token_scores, group_ids, valid)
        if cfg.use_pf_ppo:   # PF-PPO: the update sees this rank's rollouts redrawn by their scores (with replacement)
            batch = select(batch, ulysses.from_leader(pf_ppo_resample(token_scores.sum(-1), cfg.pf_ppo_reweight_method,
                                                                      cfg.pf_ppo_weight_pow)))

    # 5 update: critic, then actor (after critic_warmup steps)
    updates: dict = {}   # each model's share of the update's time, for perf/mfu
    with timed(times, "update"):
        if run.critic is not None:
            critic, critic_optim, critic_sched = run.trained["critic"]
            with recompute_activations(critic, critic_checkpointing(cfg), cfg.activation_offload), timed(updates, "critic"):
                metrics.update(update_critic(accelerator, critic, critic_optim, batch, cfg, run.autocast, run.ds,
                                             oom=run.oom))
            critic_sched.step()
        if step >= cfg.critic_warmup:   # verl: update the actor once global_steps >= critic_warmup
            actor, actor_optim, actor_sched = run.trained["actor"]
            with recompute_activations(actor, cfg.gradient_checkpointing, cfg.activation_offload), timed(updates, "actor"):
                metrics.update(update_actor(accelerator, actor, actor_optim, batch, cfg, run.autocast, run.ds, run.sft,
                                            temperature, run.guards.entropy_coeff, oom=run.oom,
                                            max_grad_norm=run.guards.max_grad_norm))
            metrics["actor/lr"] = actor_sched.get_last_lr()[0]
            actor_sched.step()

    # 6 sync: the updated actor into the rollout engine (a no-op for hf: it is the actor); one_step_off/async:
    # to the rollout side, as policy version `step`
    with timed(times, "sync"):
        if run.rollouts is not None:
            run.rollouts.send(step, actor_weights(run.actor, run.ds, cfg.rollout_sync_bucket_mb))
        else:
            engine.wake_up(["weights"])
            engine.load_weights(actor_weights(run.actor, run.ds, cfg.rollout_sync_bucket_mb))
            engine.wake_up(["kv_cache"])

    # 7 log: each metric reduced over ranks once
    with timed(times, "log"):
        metrics.update({**rollout_metrics(run, data, batch, drift, regenerated, temperature), **filtered})
        if run.peak_flops:
            metrics.update(model_flops_utilisation(run, batch, updates, times, dp))
        metrics = reduce_metrics(accelerator, {**metrics, **seconds(times)})
    # bypass mode: check_drift's first-step warning from the update's measure, which under a
    # top_p/top_k cut also holds the cut's -log kept probability (then no verdict)
    if cfg.rollout_bypass_mode and not sampling_cut(cfg):
        warn_fresh_mismatch(run, step, metrics.get("rollout/logprob_diff", float("nan")))
    metrics.update(seconds(times))   # this rank's own clock, so the phases add up to its step
    # the peak memory of each phase (the log phase's too, hence apart) and of the run: the largest of any rank
    metrics.update(reduce_metrics(accelerator, host_memory.PEAKS.of_step(times), how="max"))
    metrics["time/step_s"] = time.perf_counter() - step_start
    metrics["time/sync_share"] = metrics["time/sync_s"] / metrics["time/step_s"]   # resharding's share of the step
    metrics["perf/tokens_per_s"] = metrics.pop("perf/tokens") / metrics["time/step_s"]
    if run.peak_flops:
        metrics["perf/mfu"] = metrics.pop("perf/flops") / (metrics["time/step_s"] * run.peak_flops * world)
    return metrics


def model_flops_utilisation(run: Run, batch: dict, updates: dict, times: dict, dp: int) -> dict:
    """perf/mfu/actor and perf/mfu/critic: each update's model FLOPs (flops.py) over its time at the
    device's peak; perf/mfu/update, perf/mfu/gen and perf/mfu/forward: the update phase's, the
    generation's and the forward passes' (old log-probs, reference, values) over their phases'
    times; perf/flops: the step's model FLOPs on all ranks (perf/mfu once the step's time is
    known). Generation counts as one forward pass of the actor over the batch (rollouts drawn and
    dropped by dynamic sampling not counted); the SFT mix is not counted. A sequence-parallel group
    shares one batch's work: dp batches in all, 1/sp of one on each rank."""
    lens = batch["attention_mask"].sum(-1)                                        # [b]
    forward = {role: flops.forward(shape, lens) for role, shape in run.shapes.items()}
    trained = {role: 3 * forward[role] * schedule(run.cfg, role).epochs for role in ("actor", "critic")
               if f"time/{role}_s" in updates}
    passes = 0.0 if run.cfg.rollout_bypass_mode else forward["actor"]             # old log-probs
    passes += forward.get("ref", forward["actor"]) if "ref_logprob" in batch else 0.0   # a LoRA actor's base is the ref
    passes += forward["critic"] if "values" in batch else 0.0
    done = forward["actor"] + passes + sum(trained.values()) + forward.get("reward", 0.0)
    sp = ulysses.size()
    out = {f"perf/mfu/{role}": f / sp / (updates[f"time/{role}_s"] * run.peak_flops) for role, f in trained.items()}
    phases = {"update": sum(trained.values()), "gen": forward["actor"], "forward": passes}
    out.update({f"perf/mfu/{phase}": f / sp / (times[f"time/{phase}_s"] * run.peak_flops) for phase, f in phases.items()
                if f and times.get(f"time/{phase}_s")})   # async modes generate elsewhere: no gen phase here
    return {**out, "perf/flops": done * dp}   # the mean over ranks makes it a sum


def validate_and_log(run: Run, step: int, metrics: dict, bar, postfix: dict) -> None:
    """Phase 8's validation on its frequency, then the step's one log record and the progress bar."""
    cfg, accelerator, tracker, val, guards = run.cfg, run.accelerator, run.tracker, run.val, run.guards
    if val and cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == run.total_steps):
        start = time.perf_counter()
        val_metrics, samples = run_validation(cfg, accelerator, run.engine, run.scorer, run.tokenizer, val, run.tools)
        metrics.update(val_metrics)
        metrics["time/val_s"] = time.perf_counter() - start
        tracker.log_samples(step, samples)
    metrics["guard/rollbacks"] = guards.rollbacks
    tracker.log(step, metrics)
    if "val/accuracy" in metrics:
        bar.last_val = f"{metrics['val/accuracy']:.3f}"
    bar.set_postfix(**postfix, **({"val_acc": bar.last_val} if getattr(bar, "last_val", None) else {}))
    if "val/accuracy" in metrics or "val/score_mean" in metrics:
        tracker.log_curves()


def release_training_state(run: Run) -> None:
    """After the last step the optimizers' states, the critic, the reference and the reward model
    are freed: the final save and MLflow's model logging then reuse that memory instead of raising
    the run's peak (W3's run peaked there, above its updates). DeepSpeed engines stay as they are:
    their teardown is a collective of their own."""
    if run.ds:
        return
    for _, optim, _ in run.trained.values():
        optim.state.clear()
    run.trained = {"actor": run.trained["actor"]}
    run.critic = run.ref = run.scorer.reward_model = None
    # Accelerate's own lists of what it prepared (the actor is still the run's); then a collection, so
    # modules in reference cycles (patched forwards) go now
    run.accelerator.free_memory()


def checkpoint(run: Run, step: int) -> None:
    """Everything needed to resume exactly: models, optimizers, KL controller, data positions, guards."""
    cfg, accelerator, tracker, guards = run.cfg, run.accelerator, run.tracker, run.guards
    path = save_checkpoint(accelerator, run.ds, cfg.output_dir, cfg.save_total_limit, step, run.trained, {
        "config": dataclasses.asdict(cfg), "kl_ctrl": run.kl_ctrl.state_dict(),
        "data": {"epoch": run.stream.epoch, "pos": run.stream.pos},
        "sft_data": {"epoch": run.sft.rows.epoch, "pos": run.sft.rows.pos} if run.sft else None,
        "mlflow_run_id": tracker.run_id, "wandb_run_id": tracker.wandb_run_id, "rollbacks": guards.rollbacks,
        "entropy_reaction": guards.entropy_reaction, "guards": guards.state_dict(), "oom": run.oom.state_dict()},
        {"engine": run.engine.state_dict(), "in_flight": run.rollouts.state_dict() if run.rollouts else None})
    if accelerator.is_main_process:   # what the checkpoint holds and how it came about, for whoever finds it
        model_card.write_card(path, dataclasses.asdict(cfg), tracker.history, step=step)


def main(cfg: Config) -> None:
    from tqdm import tqdm

    console.quiet_libraries()
    run = setup(cfg)
    accelerator, tracker, val = run.accelerator, run.tracker, run.val
    if accelerator.is_main_process:
        console.header(cfg.model_path, param_share(run.actor)[1], accelerator.num_processes,
                       distributed.zero_stage(accelerator), run.engine.name, Path(cfg.output_dir),
                       getattr(tracker, "uri", ""), cfg.mlflow_experiment, run.total_steps)
    stop, guards = StopSignal(), run.guards
    optimizer_steps = cfg.ppo_epochs * (cfg.train_batch_size // cfg.ppo_mini_batch_size)
    status, final_dir, bar, early = "FAILED", None, None, None
    try:
        if val and cfg.val_before_train and not run.resumed:
            val_metrics, samples = run_validation(cfg, accelerator, run.engine, run.scorer, run.tokenizer, val, run.tools)
            tracker.log(0, val_metrics)
            guards.early_stop(0, val_metrics)   # the score to improve on
            tracker.log_samples(0, samples)
        bar = tqdm(desc="ppo", initial=run.first_step - 1, total=run.total_steps,
                   disable=not accelerator.is_main_process)
        step = run.first_step
        while step <= run.total_steps:
            metrics = train_step(run, step)   # phases 1-7
            postfix = dict(score=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics.get('kl/mean', 0):.4f}",
                           step_s=f"{metrics['time/step_s']:.2f}")

            # 8 validate, log
            validate_and_log(run, step, metrics, bar, postfix)

            # 8 guards: roll back to the last checkpoint on KL drift or a run of skipped steps
            reason = guards.check(step, metrics, optimizer_steps)
            if reason and run.rollouts is not None:
                raise UserError(f"step {step}: {reason}; a rollback is not built for rollout_mode={cfg.rollout_mode} "
                                "(batches in flight come from the weights it discards): the run stops")
            if reason:
                state = guards.rollback(step, reason, lambda path, saved: restore(run, path, saved),
                                        *run.trained["actor"][1:], accelerator.is_main_process)
                run.engine.load_weights(actor_weights(run.actor, run.ds, cfg.rollout_sync_bucket_mb))
                tracker.rewind(tracker.history, state["step"])
                step = bar.n = run.first_step
                continue

            # 8 checkpoint (on its frequency, when asked to stop, or at an early stop)
            stopping, early = stop.agreed(accelerator), guards.early_stop(step, metrics)
            on_freq = cfg.save_freq > 0 and (step % cfg.save_freq == 0 or step == run.total_steps)
            if stopping or on_freq or early:
                checkpoint(run, step)
            if stopping:
                bar.close()
                if accelerator.is_main_process:
                    print(f"stopped by a signal after step {step}; checkpoint saved, resume with the same command",
                          flush=True)
                status = "KILLED"
                return
            if early:   # every rank alike: judged on figures reduced over ranks
                if accelerator.is_main_process:
                    print(f"early stop after step {step}: {early}; checkpoint saved", flush=True)
                break
            step += 1
            bar.update(1)

        release_training_state(run)
        final_dir = save_final(accelerator, run.actor, run.tokenizer, Path(cfg.output_dir), run.ds, cfg.lora_save_merged)
        if final_dir is not None:   # the main process: the model card, before MLflow takes final/
            model_card.write_final_cards(final_dir, dataclasses.asdict(cfg), tracker.history)
        status = "FINISHED"
        if accelerator.num_processes > 1:
            print(f"rank {accelerator.process_index}/{accelerator.num_processes}: peak memory {peak_memory_gb():.2f} "
                  "GiB", flush=True)
    finally:
        if bar is not None:
            bar.close()   # before anything else is printed, so the bar's last state stays one line
        tracker.finish(status, final_dir, early)
        if accelerator.is_main_process:
            console.summary(Path(cfg.output_dir), status, tracker.history, tracker.uri, cfg.mlflow_experiment,
                            tracker.run_id, peak_memory_gb(), early)
        # a rank leaving on an error (or a second Ctrl-C) runs no collective: the others may be
        # inside a different one, and the launcher ends them once this process exits
        if status != "FAILED":
            accelerator.wait_for_everyone()
        if run.rollouts is not None:
            run.rollouts.close()
        run.scorer.shutdown()
        run.engine.shutdown()   # vLLM's teardown may already destroy the process group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(config_docs.help_text(Config))
        sys.exit(0)
    try:
        if "--dry_run" in sys.argv[1:]:
            sys.exit(0 if dry_run(load_config([a for a in sys.argv[1:] if a != "--dry_run"])) else 1)
        main(load_config())
    except UserError as e:
        sys.exit(f"error: {e}")
