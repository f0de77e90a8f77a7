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


# ------------------------------------------------------------------------------------------------
# End to end: the script on the demo model, with a reward under which chosen prompts' groups are
# constant. A prompt "a+b=" with a >= 50 scores 0 for every response (its group is dropped); any
# other scores each response by its position in its group (0, 1, ...), so its group always varies.
# ------------------------------------------------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import forkserver  # noqa: E402
from mlflow_store import sqlite_uri  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REWARD = '''
def compute_score(prompts, responses):
    n = int(__import__("os").environ["GROUP_SIZE"])
    return [0.0 if int(p.split("+")[0]) >= 50 else float(i % n) for i, p in enumerate(prompts)]
'''
# 8 prompts per step, 2 responses each; every response exactly 4 tokens, every prompt 6
RUN = ["--train_batch_size=8", "--rollout_n=2", "--ppo_mini_batch_size=4", "--ppo_micro_batch_size_per_device=8",
       "--ppo_epochs=1", "--adv_estimator=grpo", "--use_kl_in_reward=false", "--filter_groups_enable=true",
       "--filter_groups_metric=score", "--rollout_ignore_eos=true", "--max_response_length=4", "--test_freq=-1",
       "--val_before_train=false", "--mlflow_log_model=false", "--reward_fn=dsreward:compute_score"]
TOKENS_PER_STEP = 8 * 2 * (6 + 4)


def prompts_file(tmp, constant_positions, n=32, batch=8, seed=0):
    """n prompts; those at the given positions of the prompt stream's first epoch order are constant."""
    from prompts.streams import PromptStream
    stream = PromptStream(n, batch, seed)
    order = [i for _ in range(n // batch) for i in stream.next()]                 # the first epoch's order
    constant = {order[p] for p in constant_positions}
    rows = [{"prompt": f"{(60 if i in constant else 10) + i % 30}+{10 + i % 80}="} for i in range(n)]
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "dsreward.py").write_text(REWARD)
    return path


def env_for(tmp):
    return dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp), PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp),
                GROUP_SIZE="2")


def run_script(tmp, out, *extra):
    return forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={out}", *RUN, *extra],
                          cwd=tmp, env=env_for(tmp), capture_output=True, text=True, timeout=600)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# step 1: round 1 (stream positions 0-7) keeps only 0 and 1, round 2 (8-15) keeps all 8 -> 2 rounds, 10/16 kept;
# step 2: round 1 (16-23) keeps 4 (16-19), round 2 (24-31) all 8 -> 2 rounds, 12/16 kept (1.0 had the stream
# not moved on past the extra round)
CONSTANT = [2, 3, 4, 5, 6, 7, 20, 21, 22, 23]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    out = tmp / "out"
    proc = run_script(tmp, out, f"--train_files={prompts_file(tmp, CONSTANT)}", "--total_training_steps=2",
                      "--save_freq=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out


def test_constant_groups_are_refilled_to_a_full_batch_end_to_end(two_steps):
    _, out = two_steps
    rs = records(out)
    assert [r["step"] for r in rs] == [1, 2]
    assert [r["rollout/gen_rounds"] for r in rs] == [2.0, 2.0]
    assert [r["rollout/kept_groups_frac"] for r in rs] == [10 / 16, 12 / 16]
    for r in rs:
        # a full batch: 8 prompts x 2 responses trained on, all of them from varying groups (scores 0 and 1)
        assert r["perf/tokens_per_s"] * r["time/step_s"] == pytest.approx(TOKENS_PER_STEP, rel=1e-6)
        assert r["reward/score_mean"] == 0.5 and "actor/pg_loss" in r


@pytest.mark.slow   # the stop itself is tested in process above; this is the script's one-line exit
def test_a_batch_not_full_after_max_num_gen_batches_stops_naming_the_keys(tmp_path):
    proc = run_script(tmp_path, tmp_path / "out", f"--train_files={prompts_file(tmp_path, CONSTANT)}",
                      "--total_training_steps=2", "--max_num_gen_batches=1")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1:") and "max_num_gen_batches=1" in last and "filter_groups_enable" in last
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_resume_after_extra_rounds_matches_the_uninterrupted_run(two_steps, tmp_path):
    """The checkpoint after step 1 holds the stream position after its 2 rounds: resuming from it
    gives the uninterrupted run's step 2 exactly."""
    import shutil
    tmp, out = two_steps
    part = tmp_path / "part"
    shutil.copytree(out / "checkpoints" / "step_1", part / "checkpoints" / "step_1")
    proc = run_script(tmp, part, f"--train_files={tmp / 'train.jsonl'}", "--total_training_steps=2", "--save_freq=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rs]  # noqa: E731
    assert strip(records(part)) == strip(records(out)[1:])


@pytest.mark.slow
def test_zero3_two_processes_with_skewed_kept_groups_agree_on_the_rounds(tmp_path):
    """Rank 0's first share is all constant groups, rank 1's all varied: rank 1 is full after round 1
    but must generate a second round with rank 0 (ZeRO-3 gathers in every pass would hang
    otherwise); both then train on exactly their 4 groups."""
    from test_distributed import launch
    out = tmp_path / "out"
    train = prompts_file(tmp_path, range(4))          # stream positions 0-3: rank 0's share of the first batch
    proc = launch(tmp_path, ROOT / "accelerate_configs" / "zero3.yaml", f"--output_dir={out}", *RUN,
                  f"--train_files={train}", "--total_training_steps=2",
                  env_extra={"PYTHONPATH": str(tmp_path), "GROUP_SIZE": "2"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rs = records(out)
    assert [r["step"] for r in rs] == [1, 2]
    # step 1: rank 0 kept 0 then 4 of 4 per round, rank 1 4 then 4: the mean of 4/8 and 8/8
    assert rs[0]["rollout/gen_rounds"] == 2.0 and rs[0]["rollout/kept_groups_frac"] == 0.75
    assert rs[1]["rollout/gen_rounds"] == 1.0 and rs[1]["rollout/kept_groups_frac"] == 1.0
    for r in rs:   # both ranks' tokens: the full batch of 8 prompts x 2 responses
        assert r["perf/tokens_per_s"] * r["time/step_s"] == pytest.approx(TOKENS_PER_STEP, rel=1e-6)
