"""Guards that keep a long run alive (the `# guards` keys of the config).

    guards = Guards(cfg)
    reason = guards.check(step, metrics, optimizer_steps)   # after each step: None, or why to roll back
    state = guards.rollback(step, reason, restore, optim, sched, announce)

A KL drift or a run of skipped (non-finite) optimizer steps rolls back to the last checkpoint with
a lower actor lr; entropy collapse is warned about and, with entropy_floor, reacted to (another
sampling temperature and/or entropy bonus until it recovers): train_ppo reads `temperature` and
`entropy_coeff` from here every step. With nan_clip_reaction a skipped (non-finite) actor step
tightens the actor's gradient clipping (`max_grad_norm`) until a clean stretch; `early_stop` says
when the run has stopped improving (validation score or flat losses). The OOM reaction is
oom.py's.
"""
import sys

from plumbing.checkpoints import find_checkpoint, read_state
from errors import UserError


class Guards:
    """The guards' state (rollbacks so far, skipped steps in a row, the entropy reaction), saved in
    checkpoints."""

    def __init__(self, cfg):   # train_ppo's Config
        self.cfg, self.rollbacks, self.consecutive_skips = cfg, 0, 0
        self.entropy_reaction = False   # saved in checkpoints
        self.nan_clip, self.clean_steps = False, 0                       # state_dict() from here on
        self.best_val, self.stale_vals, self.last_losses, self.flat_steps = None, 0, None, 0

    @property
    def max_grad_norm(self) -> float:
        return self.cfg.nan_clip_max_grad_norm if self.nan_clip else self.cfg.max_grad_norm

    def state_dict(self) -> dict:
        return {"nan_clip": self.nan_clip, "clean_steps": self.clean_steps, "best_val": self.best_val,
                "stale_vals": self.stale_vals, "last_losses": self.last_losses, "flat_steps": self.flat_steps}

    def load_state_dict(self, state: dict | None) -> None:
        for key, value in (state or {}).items():
            setattr(self, key, value)

    @property
    def temperature(self) -> float:
        react = self.entropy_reaction and self.cfg.entropy_floor_temperature is not None
        return self.cfg.entropy_floor_temperature if react else self.cfg.temperature

    @property
    def entropy_coeff(self) -> float:
        react = self.entropy_reaction and self.cfg.entropy_floor_coeff is not None
        return self.cfg.entropy_floor_coeff if react else self.cfg.entropy_coeff

    def check(self, step: int, metrics: dict, optimizer_steps: int) -> str | None:
        """-> why to roll back now, or None. Also warns (stderr) about a collapsing entropy and
        switches the entropy reaction on or off for the next step."""
        cfg = self.cfg
        skipped = int(metrics.get("actor/skipped_steps", 0))
        self.consecutive_skips = self.consecutive_skips + skipped if skipped == optimizer_steps else skipped
        entropy = metrics.get("actor/entropy")
        if cfg.entropy_warn_threshold > 0 and entropy is not None and entropy < cfg.entropy_warn_threshold:
            print(f"warning: step {step}: actor/entropy={entropy:.4g} < entropy_warn_threshold="
                  f"{cfg.entropy_warn_threshold} (entropy collapse)", file=sys.stderr, flush=True)
        # judged at the configured temperature: actor/entropy is measured at the sampling one, which
        # a temperature reaction moves at once, so on it the reaction would undo itself every step.
        # The band between entropy_floor and entropy_recover is the hysteresis
        measure = metrics.get("guard/entropy")
        if cfg.entropy_floor > 0 and measure is not None:
            turn_on = not self.entropy_reaction and measure < cfg.entropy_floor
            turn_off = self.entropy_reaction and cfg.entropy_recover > 0 and measure > cfg.entropy_recover
            if turn_on or turn_off:
                self.entropy_reaction = turn_on
                print(f"warning: step {step}: guard/entropy={measure:.4g} "
                      f"{'< entropy_floor' if turn_on else '> entropy_recover'}: from the next step temperature="
                      f"{self.temperature:g}, entropy_coeff={self.entropy_coeff:g}", file=sys.stderr, flush=True)
        if cfg.nan_clip_reaction and "actor/skipped_steps" in metrics:
            self._nan_clip(step, skipped)
        if cfg.kl_rollback_threshold > 0 and metrics.get("kl/mean", 0.0) > cfg.kl_rollback_threshold:
            return f"kl/mean={metrics['kl/mean']:.4g} > kl_rollback_threshold={cfg.kl_rollback_threshold}"
        if cfg.max_consecutive_skips > 0 and self.consecutive_skips >= cfg.max_consecutive_skips:
            return f"{self.consecutive_skips} optimizer steps in a row skipped for a non-finite gradient norm"
        return None

    def _nan_clip(self, step: int, skipped: int) -> None:
        """On at a skipped actor step; off after nan_clip_clean_steps steps in a row without one (a
        skip while reacting starts the stretch again, so it cannot flap at every other step)."""
        cfg, was = self.cfg, self.nan_clip
        if skipped:
            self.nan_clip, self.clean_steps = True, 0
        elif self.nan_clip:
            self.clean_steps += 1
            self.nan_clip = self.clean_steps < cfg.nan_clip_clean_steps
        if self.nan_clip != was:
            why = (f"{skipped} actor step(s) skipped for a non-finite gradient norm" if self.nan_clip else
                   f"{self.clean_steps} steps in a row without a skipped actor step")
            print(f"warning: step {step}: {why}: from the next step max_grad_norm={self.max_grad_norm:g} "
                  "(nan_clip_reaction)", file=sys.stderr, flush=True)

    def early_stop(self, step: int, metrics: dict) -> str | None:
        """After a step's log (or the validation before training, step 0) -> why to stop now, or
        None. Every rank decides alike: the figures are reduced over ranks."""
        cfg = self.cfg
        key = "val/accuracy" if "val/accuracy" in metrics else "val/score_mean"
        if cfg.early_stop_patience > 0 and key in metrics:
            if self.best_val is None or metrics[key] > self.best_val:
                self.best_val, self.stale_vals = metrics[key], 0
            else:
                self.stale_vals += 1
            if self.stale_vals >= cfg.early_stop_patience:
                return (f"early_stop_patience: {key} has not improved on its best {self.best_val:.4g} for "
                        f"{self.stale_vals} validations")
        losses = [metrics[k] for k in ("actor/pg_loss", "critic/vf_loss") if k in metrics]
        if cfg.early_stop_loss_rtol > 0 and losses:
            last, self.last_losses = self.last_losses, losses
            flat = last is not None and len(last) == len(losses) and all(
                abs(now - before) <= cfg.early_stop_loss_rtol * abs(before) for now, before in zip(losses, last))
            self.flat_steps = self.flat_steps + 1 if flat else 0
            if self.flat_steps >= cfg.early_stop_loss_steps:
                return (f"early_stop_loss_rtol: the losses changed by less than {cfg.early_stop_loss_rtol:g} of "
                        f"themselves for {self.flat_steps} steps in a row")
        return None

    def rollback(self, step: int, reason: str, restore, optim, sched, announce: bool) -> dict:
        """Reload the newest complete checkpoint through restore(path, state) (models, optimizers,
        RNGs, data position) and scale the actor's learning rate (optim, sched) by
        rollback_lr_factor per rollback -> that checkpoint's state."""
        cfg = self.cfg
        self.rollbacks += 1
        self.consecutive_skips = 0
        if self.rollbacks > cfg.max_rollbacks:
            raise UserError(f"step {step}: {reason}; giving up after max_rollbacks={cfg.max_rollbacks} rollbacks "
                            f"(lower actor_lr or raise kl_rollback_threshold, and resume with the same command "
                            f"and that change)")
        path = find_checkpoint("auto", cfg.output_dir)
        if path is None:
            raise UserError(f"step {step}: {reason}, and there is no checkpoint to roll back to: set save_freq")
        state = read_state(path)
        restore(path, state)
        scale = cfg.rollback_lr_factor ** (self.rollbacks - state.get("rollbacks", 0))   # its lr may be scaled already
        rescale_lr(optim, sched, scale * resumed_lr_scale(cfg.actor_lr, state))
        if announce:
            print(f"warning: step {step}: {reason}; rolling back to {path} with actor lr x{scale:g} "
                  f"(rollback {self.rollbacks}/{cfg.max_rollbacks})", file=sys.stderr, flush=True)
        return state


def resumed_lr_scale(actor_lr: float, state: dict) -> float:
    """A checkpoint's schedule carries the actor_lr it was made with (times any rollbacks'
    factors): the factor that makes it the configured one, e.g. after the advice to lower it."""
    saved = state.get("config", {}).get("actor_lr", actor_lr)
    return actor_lr / saved if saved else 1.0


def rescale_lr(optim, sched, scale: float) -> None:
    """Multiply the actor's learning rate (the schedule's base and the optimizer's current one) by scale."""
    sched.base_lrs = [lr * scale for lr in sched.base_lrs]
    for group, base in zip(optim.param_groups, sched.base_lrs):
        group["lr"] = base * sched.lr_lambdas[0](sched.last_epoch)
    sched._last_lr = [group["lr"] for group in optim.param_groups]   # what actor/lr logs before the next step
