"""DAPO dynamic sampling (rollout/dynamic_sampling.py): which groups are kept, how rounds refill the
batch, when it stops, and what each metric means. Hand-made scores; the end-to-end runs (single
process, 2-process ZeRO-3, resume) are in test_e2e.py, test_distributed.py and test_resume.py."""
import pytest
import torch

from config import Config
from errors import UserError
from rollout.dynamic_sampling import Sampled, fill_groups, group_metric, varied_groups

EOS = 2


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_groups_whose_values_all_agree_are_dropped():
    # groups of 2: (1, 1) constant, (0, 1) varied, (0, 0) constant, (0.5, 0.5) constant, (0.25, 0.5) varied
    assert varied_groups(t([1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.25, 0.5]), 2).tolist() == [False, True, False, False, True]
    # groups of 3: one differing member is enough
    assert varied_groups(t([0, 0, 1, 2, 2, 2]), 3).tolist() == [True, False]
    # a group of one is always kept (verl)
    assert varied_groups(t([3, 3, 3]), 1).tolist() == [True, True, True]


class Rounds:
    """A stream of rounds with hand-made scores: round r's prompts are 10r, 10r+1, ...; each group
    of 2 responses gets the two scores given for it."""

    def __init__(self, scores_per_round):
        self.scores = scores_per_round
        self.drawn = 1          # round 1's prompts are given to fill_groups directly
        self.again = []

    def first(self):
        return self.prompts(0)

    def prompts(self, r):
        return [10 * r + g for g in range(len(self.scores[r]) // 2)]

    def draw(self):
        self.drawn += 1
        return self.prompts(self.drawn - 1)

    def sample(self, idx, again):
        self.again.append(again)
        r = idx[0] // 10
        responses = [[i, j, EOS] for i in idx for j in range(2)]
        return Sampled(idx, responses, [[-0.5] * 3 for _ in responses], t(self.scores[r]))


def test_constant_groups_are_refilled_from_further_rounds_and_trimmed_to_the_share():
    rounds = Rounds([[1, 1, 0, 0, 0, 1, 1, 1],      # round 1: only prompt 2 varies
                     [0, 0, 1, 0, 1, 1, 0, 0],      # round 2: only prompt 11
                     [1, 0, 0, 1, 1, 1, 0, 1]])     # round 3: prompts 20, 21, 23
    out, metrics = fill_groups(rounds.first(), rounds.draw, rounds.sample, lambda part: part.scores,
                               lambda count: count, share=4, n=2, max_rounds=0, step=1)
    assert out.idx == [2, 11, 20, 21]                       # the first 4 kept, in the order sampled (23 trimmed)
    assert out.scores.tolist() == [0, 1, 1, 0, 1, 0, 0, 1]
    assert out.responses == [[2, 0, EOS], [2, 1, EOS], [11, 0, EOS], [11, 1, EOS], [20, 0, EOS], [20, 1, EOS],
                             [21, 0, EOS], [21, 1, EOS]]
    assert len(out.logprobs) == 8
    assert metrics == {"rollout/kept_groups_frac": 5 / 12, "rollout/gen_rounds": 3.0}
    assert rounds.drawn == 3 and rounds.again == [False, True, True]


def test_a_full_first_round_draws_nothing_more():
    rounds = Rounds([[1, 0, 0, 1], [1, 0, 0, 1]])
    out, metrics = fill_groups(rounds.first(), rounds.draw, rounds.sample, lambda part: part.scores,
                               lambda count: count, share=2, n=2, max_rounds=0, step=1)
    assert out.idx == [0, 1] and metrics == {"rollout/kept_groups_frac": 1.0, "rollout/gen_rounds": 1.0}
    assert rounds.drawn == 1


def test_stops_after_max_num_gen_batches_rounds_naming_the_keys():
    rounds = Rounds([[1, 1, 0, 0]] * 5)                     # nothing ever varies
    with pytest.raises(UserError) as stop:
        fill_groups(rounds.first(), rounds.draw, rounds.sample, lambda part: part.scores, lambda count: count,
                    share=2, n=2, max_rounds=3, step=7)
    msg = str(stop.value)
    assert "step 7" in msg and "max_num_gen_batches=3" in msg and "filter_groups_enable" in msg
    assert rounds.drawn == 3                                # exactly max_num_gen_batches rounds generated


def test_the_rounds_are_decided_by_the_rank_that_holds_the_fewest():
    """This rank is full after round 1, but another rank (its held counts given per round) is not:
    every rank must run the same rounds, so this one samples again and keeps only its share."""
    rounds = Rounds([[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1]])
    others, seen = iter([0, 1, 2]), []

    def agree_min(count):
        seen.append(count)
        return min(count, next(others))

    out, metrics = fill_groups(rounds.first(), rounds.draw, rounds.sample, lambda part: part.scores, agree_min,
                               share=2, n=2, max_rounds=0, step=1)
    assert seen == [2, 4, 6] and metrics["rollout/gen_rounds"] == 3.0
    assert out.idx == [0, 1] and metrics["rollout/kept_groups_frac"] == 1.0


def metric_of(metric, scores, responses, **cfg):
    part = Sampled(list(range(len(responses) // 2)), responses, None, t(scores))
    return group_metric(Config(filter_groups_metric=metric, **cfg), part, EOS, is_verifier=True)


def test_seq_reward_is_the_shaped_score_so_overlong_shaping_can_make_a_group_vary():
    # equal raw scores; the second response is 4 tokens long, at the end of the overlong buffer of 2 (penalty 1)
    responses = [[5, EOS], [5, 6, 7, EOS]]
    shaped = metric_of("seq_reward", [1.0, 1.0], responses, max_response_length=4, overlong_buffer_len=2)
    assert shaped.tolist() == [1.0, 0.0]
    assert varied_groups(shaped, 2).tolist() == [True]
    raw = metric_of("score", [1.0, 1.0], responses, max_response_length=4, overlong_buffer_len=2)
    assert raw.tolist() == [1.0, 1.0] and varied_groups(raw, 2).tolist() == [False]


def test_acc_counts_right_and_wrong_and_needs_a_verifier():
    acc = metric_of("acc", [1.0, 0.0, 0.5, 0.25], [[5, EOS]] * 4)
    assert acc.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert varied_groups(acc, 2).tolist() == [True, False]  # 0.5 and 0.25 differ as scores, not as accuracy
    part = Sampled([0], [[5, EOS], [6, EOS]], None, t([1.0, 0.0]))
    with pytest.raises(UserError, match="acc needs a verifier"):
        group_metric(Config(filter_groups_metric="acc"), part, EOS, is_verifier=False)
