"""Tests for kl/: estimators (hand-worked values, exact KL of small categoricals, straight-through
gradients, name errors) and controllers (direction, clipping, validation, checkpoint round-trip).

Every expected number below is worked out by hand from the definitions in verl 0.9.1's code (docs/math.md).
Run from the repo root: python -m pytest tests/test_kl.py -q
"""

import json
import math

import pytest
import torch

from kl import (
    CONTROLLERS,
    ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimator_names,
    kl_penalty,
    make_kl_controller,
)

LN2 = math.log(2)
FAMILIES = {"k1": ["k1", "kl"], "abs": ["abs"], "k2": ["k2", "mse"], "k3": ["k3", "low_var_kl"]}


def with_plus(names):
    return names + [n + "+" for n in names]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# Estimators: hand-worked values
# --------------------------------------------------------------------------------------------

# (d, expected) per family, d = logprob - ref_logprob.
# k3: x = clamp(-d, -20, 20); clamp(exp(x) - x - 1, -10, 10)
HAND = {
    "k1": [(LN2, LN2), (-LN2, -LN2), (0.0, 0.0), (-30.0, -30.0)],
    "abs": [(LN2, LN2), (-LN2, LN2), (0.0, 0.0), (-30.0, 30.0)],
    "k2": [(LN2, 0.5 * LN2**2), (-LN2, 0.5 * LN2**2), (0.0, 0.0), (-30.0, 450.0)],
    "k3": [
        (LN2, 0.5 + LN2 - 1),             # x = -ln2: exp(x) = 1/2
        (-LN2, 2 - LN2 - 1),              # x = ln2:  exp(x) = 2
        (0.0, 0.0),
        (2.0, math.exp(-2) + 2 - 1),      # x = -2
        (-2.5, math.exp(2.5) - 2.5 - 1),  # x = 2.5: 8.68, just under the cap
        (-3.0, 10.0),                     # x = 3: e^3 - 4 = 16.09 -> capped at 10
        (-30.0, 10.0),                    # x = 30 -> 20; e^20 - 21 -> 10
        (30.0, 10.0),                     # x = -30 -> -20; e^-20 + 19 -> 10
    ],
}
HAND_CASES = [
    (name, d, expected)
    for family, names in FAMILIES.items()
    for name in with_plus(names)
    for d, expected in HAND[family]
]


@pytest.mark.parametrize("name,d,expected", HAND_CASES)
def test_hand_worked_values(name, d, expected):
    ref = t([[-1.3]])  # [1, 1], any reference: only the difference matters
    out = kl_penalty(ref + d, ref, name)
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_direction_is_log_pi_over_ref():
    # pi(x) = 1/2, ref(x) = 1/4: d = log 2 > 0, not -log 2
    logprob, ref = torch.log(t([[0.5]])), torch.log(t([[0.25]]))
    assert kl_penalty(logprob, ref, "k1").item() == pytest.approx(LN2)
    assert kl_penalty(logprob, ref, "k3").item() == pytest.approx(LN2 - 0.5)


def test_k3_infinite_log_ratio_is_capped_not_nan():
    # A token the reference (or the policy) gives probability 0: without the inner clamp,
    # exp(inf) - inf would be nan.
    logprob = t([[float("-inf"), 0.0]])  # [1, 2]
    ref = t([[0.0, float("-inf")]])  # [1, 2]
    out = kl_penalty(logprob, ref, "k3")
    assert torch.equal(out, t([[10.0, 10.0]]))


def test_every_name_keeps_shape_and_is_elementwise():
    torch.manual_seed(0)
    logprob, ref = -torch.rand(3, 5, dtype=torch.float64), -torch.rand(3, 5, dtype=torch.float64)  # [B, T]
    for name in kl_estimator_names():
        out = kl_penalty(logprob, ref, name)
        assert out.shape == (3, 5), name
        # one token's value does not depend on its neighbours
        single = kl_penalty(logprob[1:2, 2:3], ref[1:2, 2:3], name)
        assert out[1, 2].item() == pytest.approx(single.item(), rel=1e-12), name


def test_names_are_the_documented_set():
    base = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
    assert set(ESTIMATORS) == set(base)
    assert set(kl_estimator_names()) == set(base) | {n + "+" for n in base}


# --------------------------------------------------------------------------------------------
# Estimators against the exact KL of small categoricals
# --------------------------------------------------------------------------------------------

def expectation(p, q, name):
    """E_{x~p}[estimator(log p(x) - log q(x))], weighting each category by p(x)."""
    return (p * kl_penalty(p.log(), q.log(), name)).sum(-1)  # [B]


def test_unbiased_estimators_equal_hand_worked_kl():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL(p||q) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    p, q = t([[0.5, 0.5]]), t([[0.25, 0.75]])
    kl_exact = 0.5 * math.log(4 / 3)
    for name in ["k1", "kl", "k3", "low_var_kl", "k1+", "k3+"]:
        assert expectation(p, q, name).item() == pytest.approx(kl_exact, rel=1e-12), name
    # |E X| <= E|X|: abs overestimates (here strictly: the log-ratios have opposite signs)
    assert expectation(p, q, "abs").item() > kl_exact + 0.05


def test_unbiased_estimators_match_torch_kl_on_random_categoricals():
    torch.manual_seed(0)
    p = torch.softmax(0.5 * torch.randn(16, 6, dtype=torch.float64), -1)  # [B, V]
    q = torch.softmax(0.5 * torch.randn(16, 6, dtype=torch.float64), -1)  # [B, V]
    # precondition: no k3 clamp binds, so k3 is exactly unbiased here
    assert kl_penalty(p.log(), q.log(), "k3").max() < 10
    kl_exact = torch.distributions.kl_divergence(
        torch.distributions.Categorical(probs=p), torch.distributions.Categorical(probs=q)
    )  # [B]
    assert kl_exact.min() > 0.01  # the distributions really differ
    for name in ["k1", "k3"]:
        torch.testing.assert_close(expectation(p, q, name), kl_exact, rtol=1e-10, atol=1e-12)
    assert (expectation(p, q, "abs") >= kl_exact - 1e-12).all()


def test_k3_cap_makes_it_biased_low_when_ref_is_much_likelier():
    # verl's quirk, kept: p = (0.05, 0.95), q = (0.95, 0.05). On category 0, q/p = 19, so
    # exp(x) - x - 1 = 18 - ln 19 = 15.06 is capped to 10; the expectation loses 0.05 * (8 - ln 19).
    p, q = t([[0.05, 0.95]]), t([[0.95, 0.05]])
    kl_exact = 0.05 * math.log(0.05 / 0.95) + 0.95 * math.log(0.95 / 0.05)  # 0.9 ln 19
    assert expectation(p, q, "k1").item() == pytest.approx(kl_exact, rel=1e-12)
    assert expectation(p, q, "k3").item() == pytest.approx(kl_exact - 0.05 * (8 - math.log(19)), rel=1e-12)


def test_k2_is_nonnegative_and_close_to_kl_for_close_distributions():
    torch.manual_seed(1)
    logits = torch.randn(8, 5, dtype=torch.float64)  # [B, V]
    p = torch.softmax(logits, -1)
    q_close = torch.softmax(logits + 0.02 * torch.randn_like(logits), -1)
    q_far = torch.softmax(torch.randn_like(logits), -1)
    for q in (q_close, q_far):
        assert (kl_penalty(p.log(), q.log(), "k2") >= 0).all()
        assert (expectation(p, q, "k2") >= 0).all()
    kl_close = (p * (p / q_close).log()).sum(-1)  # [B]
    # k2 agrees with KL to second order in the log-ratio; the gap is third order
    torch.testing.assert_close(expectation(p, q_close, "k2"), kl_close, rtol=0.05, atol=0)


# --------------------------------------------------------------------------------------------
# Straight-through "+" variants: value of the base, gradient of k2 (= d w.r.t. logprob)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_value_is_base_and_gradient_is_d(name):
    logprob = t([[LN2, -LN2, 0.3, -3.0]]).requires_grad_()  # [1, 4]
    ref = t([[0.0, 0.0, -0.1, 0.0]]).requires_grad_()  # [1, 4]
    d = t([[LN2, -LN2, 0.4, -3.0]])
    out = kl_penalty(logprob, ref, name)
    torch.testing.assert_close(out.detach(), kl_penalty(logprob.detach(), ref.detach(), name[:-1]))
    out.sum().backward()
    torch.testing.assert_close(logprob.grad, d)
    torch.testing.assert_close(ref.grad, -d)


def test_base_gradients_differ_from_k2():
    # the "+" variants change something: k1's gradient is 1, k3's is 1 - exp(-d)
    logprob = t([[LN2]]).requires_grad_()  # [1, 1], d = ln 2 with ref = 0
    kl_penalty(logprob, t([[0.0]]), "k1").sum().backward()
    assert logprob.grad.item() == pytest.approx(1.0)
    logprob.grad = None
    kl_penalty(logprob, t([[0.0]]), "k3").sum().backward()
    assert logprob.grad.item() == pytest.approx(1 - 0.5)  # not ln 2 = 0.693


# --------------------------------------------------------------------------------------------
# Unknown names
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["k4", "full", "K1", "", "+", "k3++", "kl ", "low-var-kl"])
def test_unknown_estimator_raises_listing_valid_names(bad):
    with pytest.raises(ValueError) as info:
        kl_penalty(t([[0.0]]), t([[0.0]]), bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in kl_estimator_names():
        assert name in message


# --------------------------------------------------------------------------------------------
# Controllers
# --------------------------------------------------------------------------------------------

def test_fixed_never_changes():
    ctrl = FixedKLController(0.05)
    for current_kl, n_steps in [(0.0, 1), (100.0, 512), (-3.0, 8), (float("inf"), 1)]:
        ctrl.update(current_kl, n_steps)
        assert ctrl.value == 0.05


@pytest.mark.parametrize(
    "current_kl,expected",
    [
        (1.0, 0.1 * (1 + 0.2 * 5 / 10)),     # e = 9 clipped to 0.2 -> 0.11
        (0.15, 0.1 * (1 + 0.2 * 5 / 10)),    # e = 0.5 clipped to 0.2 -> 0.11
        (0.11, 0.1 * (1 + 0.1 * 5 / 10)),    # e = 0.1, inside the clip -> 0.105
        (0.1, 0.1),                          # e = 0: at target, unchanged
        (0.09, 0.1 * (1 - 0.1 * 5 / 10)),    # e = -0.1 -> 0.095
        (0.0, 0.1 * (1 - 0.2 * 5 / 10)),     # e = -1 clipped to -0.2 -> 0.09
    ],
)
def test_adaptive_update_hand_worked(current_kl, expected):
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    ctrl.update(current_kl, n_steps=5)
    assert ctrl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_direction_and_compounding():
    up = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    up.update(1.0, 5)
    up.update(1.0, 5)
    assert up.value == pytest.approx(0.1 * 1.1 * 1.1)  # 0.121
    down = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    down.update(0.0, 5)
    down.update(0.0, 5)
    assert down.value == pytest.approx(0.1 * 0.9 * 0.9)  # 0.081


def test_adaptive_accepts_tensor_and_numpy_kl_and_keeps_plain_float():
    np = pytest.importorskip("numpy")
    ctrl = AdaptiveKLController(0.1, 0.1, 10)
    ctrl.update(torch.tensor(1.0), 5)
    ctrl.update(np.float64(1.0), 5)
    assert type(ctrl.value) is float
    assert ctrl.value == pytest.approx(0.121)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(target_kl=0.0, horizon=10), "target_kl"),
        (dict(target_kl=-0.1, horizon=10), "target_kl"),
        (dict(target_kl=float("nan"), horizon=10), "target_kl"),
        (dict(target_kl=0.1, horizon=0), "horizon"),
        (dict(target_kl=0.1, horizon=-5), "horizon"),
    ],
)
def test_adaptive_invalid_settings_raise(kwargs, arg):
    with pytest.raises(ValueError) as info:
        AdaptiveKLController(init_kl_coef=0.1, **kwargs)
    assert arg in str(info.value)
    assert repr(kwargs[arg]) in str(info.value)


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_state_dict_round_trip_through_json(kind):
    ctrl = make_kl_controller(kind, kl_coef=0.1, target_kl=0.1, horizon=10)
    ctrl.update(1.0, 5)
    state = ctrl.state_dict()
    for v in state.values():
        assert type(v) in (float, str), state
    restored = make_kl_controller(kind, kl_coef=0.7, target_kl=3.0, horizon=99)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.value == ctrl.value
    assert restored.state_dict() == state
    # and it keeps going exactly as the original would
    ctrl.update(0.0, 5)
    restored.update(0.0, 5)
    assert restored.value == ctrl.value


def test_adaptive_state_survives_after_update():
    ctrl = AdaptiveKLController(0.1, 0.1, 10)
    ctrl.update(1.0, 5)
    fresh = AdaptiveKLController(0.1, 0.1, 10)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == pytest.approx(0.11)  # not the init value 0.1


def test_load_state_dict_of_other_kind_raises():
    with pytest.raises(ValueError):
        FixedKLController(0.1).load_state_dict(AdaptiveKLController(0.1, 0.1, 10).state_dict())
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, 0.1, 10).load_state_dict(FixedKLController(0.1).state_dict())


def test_make_kl_controller_builds_each_kind():
    fixed = make_kl_controller("fixed", kl_coef=0.2, target_kl=0.1, horizon=10)
    adaptive = make_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=10)
    assert type(fixed) is CONTROLLERS["fixed"] and fixed.value == 0.2
    assert type(adaptive) is CONTROLLERS["adaptive"] and adaptive.value == 0.2
    adaptive.update(1.0, 5)
    assert adaptive.value == pytest.approx(0.22)  # uses target_kl and horizon as given
    with pytest.raises(ValueError):
        make_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=0)


@pytest.mark.parametrize("bad", ["Fixed", "pid", ""])
def test_make_kl_controller_unknown_type_raises(bad):
    with pytest.raises(ValueError) as info:
        make_kl_controller(bad, kl_coef=0.1, target_kl=0.1, horizon=10)
    message = str(info.value)
    assert repr(bad) in message and "fixed" in message and "adaptive" in message
