"""Guards that keep a long run alive (the `# guards` keys of the config).

    guards = Guards(cfg)
    reason = guards.check(step, metrics, optimizer_steps)   # after each step: None, or why to roll back
    state = guards.rollback(step, reason, restore, optim, sched, announce)

A KL drift or a run of skipped (non-finite) optimizer steps rolls back to the last checkpoint with
a lower actor lr; entropy collapse is warned about and, with entropy_floor, reacted to (another
sampling temperature and/or entropy bonus until it recovers): train_ppo reads `temperature` and
`entropy_coeff` from here every step.
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
        if cfg.kl_rollback_threshold > 0 and metrics.get("kl/mean", 0.0) > cfg.kl_rollback_threshold:
            return f"kl/mean={metrics['kl/mean']:.4g} > kl_rollback_threshold={cfg.kl_rollback_threshold}"
        if cfg.max_consecutive_skips > 0 and self.consecutive_skips >= cfg.max_consecutive_skips:
            return f"{self.consecutive_skips} optimizer steps in a row skipped for a non-finite gradient norm"
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
