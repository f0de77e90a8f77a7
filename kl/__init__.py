"""KL estimators and KL-coefficient controllers (verl 0.9.1 definitions, same numbers).

Estimators turn per-token log-probs of the sampled tokens into a per-token KL estimate.
With d = logprob - ref_logprob = log(pi(x) / ref(x)) and x sampled from pi
(Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html):

    k1  (alias "kl")          d                            unbiased, high variance, can be < 0
    abs                       |d|                          biased upward, always >= 0
    k2  (alias "mse")         0.5 * d^2                    biased, low variance; its gradient is
                                                           the right gradient of KL in expectation
    k3  (alias "low_var_kl")  exp(-d) + d - 1              unbiased, low variance, always >= 0
                              (with verl's clamps, see _k3)
    name + "+"                value of `name`, gradient of k2 (straight-through), e.g. "k3+"

Controllers hold the coefficient beta of the KL term in the reward (train_ppo.py reads `.value`
before calling `.update(current_kl, n_steps)`):

    fixed      beta never changes
    adaptive   beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon
               (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593)

Adding an estimator: one function of d, one entry in ESTIMATORS; its "+" form comes for free.
"""

import torch

__all__ = [
    "ESTIMATORS",
    "kl_penalty",
    "kl_estimator_names",
    "FixedKLController",
    "AdaptiveKLController",
    "CONTROLLERS",
    "make_kl_controller",
]


# ---------------------------------------------------------------------------------------------
# Estimators: functions of the log-ratio d = logprob - ref_logprob, any shape in, same shape out.
# ---------------------------------------------------------------------------------------------

def _k1(d):
    return d  # [B, T]


def _abs(d):
    return d.abs()  # [B, T]


def _k2(d):
    return 0.5 * d.square()  # [B, T]


def _k3(d):
    # x = log(ref / pi). The inner clamp keeps exp() finite, so an infinite log-ratio (a token the
    # reference gives probability 0) yields 10 instead of inf - inf = nan. The outer clamp caps a
    # single token's penalty; exp(x) - x - 1 >= 0, so in practice only the upper bound is hit.
    x = torch.clamp(-d, min=-20, max=20)  # [B, T]
    return torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)  # [B, T]


ESTIMATORS = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def kl_estimator_names():
    """Every name kl_penalty accepts: each estimator and its straight-through "+" form."""
    return list(ESTIMATORS) + [name + "+" for name in ESTIMATORS]


def kl_penalty(logprob, ref_logprob, name):
    """Per-token KL estimate [B, T] of pi against ref, from log-probs of the sampled tokens [B, T].

    A name ending in "+" is straight-through: the forward value is the base estimator's, the
    gradient is k2's (d, w.r.t. logprob), because k1's and k3's own gradients are not the
    gradient of KL in expectation while k2's is. "k2+" / "mse+" therefore equal plain k2.
    """
    base = name[:-1] if name.endswith("+") else name
    if base not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid names: {', '.join(kl_estimator_names())}")
    d = logprob - ref_logprob  # [B, T]
    value = ESTIMATORS[base](d)  # [B, T]
    if base == name:
        return value
    grad_carrier = 0.5 * d.square()  # [B, T]  k2, whose gradient we want
    # zero in value, k2 in gradient; plus the base value with no gradient
    return grad_carrier - grad_carrier.detach() + value.detach()  # [B, T]


# ---------------------------------------------------------------------------------------------
# Controllers: `value`, `update(current_kl, n_steps)`, `state_dict()`, `load_state_dict(d)`.
# State is plain floats and strings so a checkpoint can store it as JSON.
# ---------------------------------------------------------------------------------------------

def _check_type(state, expected):
    if state.get("type") != expected:
        raise ValueError(f"state_dict is for a {state.get('type')!r} KL controller, not {expected!r}")


class FixedKLController:
    """beta = kl_coef for the whole run."""

    def __init__(self, kl_coef):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps):
        pass

    def state_dict(self):
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state):
        _check_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Moves beta toward the value that keeps the measured KL at target_kl.

    The error is clipped to +-20% so one noisy batch cannot swing beta far; with n_steps = the
    number of sequences in the batch, beta changes by at most about 20% every `horizon` sequences.
    """

    def __init__(self, init_kl_coef, target_kl, horizon):
        # verl only asserts horizon > 0; target_kl <= 0 would divide by zero or flip the sign.
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl!r}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps):
        # float() so a tensor or numpy scalar never leaks into the state
        error = min(max(float(current_kl) / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self):
        return {"type": "adaptive", "value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state):
        _check_type(state, "adaptive")
        # a resumed run continues exactly the run that was saved, settings included
        saved = AdaptiveKLController(state["value"], state["target_kl"], state["horizon"])  # validates
        self.value, self.target_kl, self.horizon = saved.value, saved.target_kl, saved.horizon


CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def make_kl_controller(kl_ctrl_type, kl_coef, target_kl, horizon):
    """The controller named kl_ctrl_type; "fixed" ignores target_kl and horizon."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kl_ctrl_type!r}; valid types: {', '.join(CONTROLLERS)}")
