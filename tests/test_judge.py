"""The LLM judge (rewards/judge.py): parsers, unreadable verdicts and their fallback, batching,
the config's conflicts, --dry_run's memory rows, and runs of train_ppo.py with the judge as the
only reward (the recipe configs/demo_judge.yaml learning, 2 processes with a vLLM judge per rank).

The judge is examples/demo_judge_model, whose weights are set, not trained: it writes the last
character of the text it reads when that is a digit, else "?" (examples/make_demo_judge.py), the
same on every CPU, so the verdicts below are known without running it.
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import forkserver
from config import Config, validate_config
from errors import UserError
from mlflow_store import sqlite_uri
from ports import free_port
from rewards.judge import Judge, prefer_a, score_in_range

ROOT = Path(__file__).resolve().parents[1]
JUDGE = ROOT / "examples" / "demo_judge_model"
TEMPLATE = ROOT / "examples" / "demo_judge_template.jinja"


def judge_config(**kw) -> Config:
    keys = dict(reward_judge_path=str(JUDGE), reward_judge_template=str(TEMPLATE), reward_judge_range="0,9",
                reward_judge_max_tokens=1, reward_judge_prompt_length=32)
    return dataclasses.replace(Config(), **{**keys, **kw})


def message(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    return str(e.value)


# ----------------------------------------------------------------------------------------------
# Parsers

def test_score_in_range_reads_the_last_number_scaled():
    assert score_in_range("Score: 7/10", {}) == pytest.approx(0.7)              # a denominator is not the score
    assert score_in_range("first 2, then on reflection 8", {}) == pytest.approx(0.8)
    assert score_in_range("4.5", {}, judge_range=(1.0, 5.0)) == pytest.approx(0.875)
    assert score_in_range("-1", {}, judge_range=(-2.0, 2.0)) == pytest.approx(0.25)
    assert score_in_range("11", {}) is None                                     # outside the range
    assert score_in_range("no idea", {}) is None


def test_prefer_a_reads_the_last_mark_or_a_bare_letter():
    assert prefer_a("A is clearer. [[A]]", {}) == 1.0
    assert prefer_a("[[A]] at first, but [[B]]", {}) == 0.0
    assert prefer_a("[[C]]", {}) == 0.5
    assert prefer_a(" b.", {}) == 0.0
    assert prefer_a("both are fine", {}) is None


# ----------------------------------------------------------------------------------------------
# The judge on its hf engine

@pytest.fixture(scope="module")
def judge():
    made = Judge(judge_config())
    made.start(world=1, rank=0)
    return made


def test_verdicts_scores_and_fallback(judge):
    prompts = ["47+38=", "10+19=", "12+3=", "20+20="]
    scores, verdicts, unreadable = judge(prompts, ["85", "29", "", "4x"], {})
    assert verdicts == ["5", "9", "?", "?"]
    assert scores.tolist() == pytest.approx([5 / 9, 1.0, 0.0, 0.0])
    assert unreadable == [False, False, True, True]


def test_configured_fallback_and_a_parser_that_fails(judge, tmp_path, monkeypatch):
    (tmp_path / "my_parsers.py").write_text(
        "def picky(text, row):\n"
        "    if text == '5':\n        raise ValueError('five')\n"
        "    return float('nan') if text == '9' else 'high' if text == '8' else float(text)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    other = Judge(judge_config(reward_judge_parser="my_parsers:picky", reward_judge_fallback=-1.0))
    other.tokenizer, other.engine = judge.tokenizer, judge.engine   # the same model: no second load
    scores, _, unreadable = other(["1+1="] * 4, ["15", "19", "18", "13"], {})
    assert scores.tolist() == [-1.0, -1.0, -1.0, 3.0]    # raised, NaN, not a number: the fallback
    assert unreadable == [True, True, True, False]


def test_one_batched_call_scores_what_single_calls_do(judge):
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 40, 3), range(50, 80, 3))]
    responses = [str(a + b)[::-1] for a, b in zip(range(10, 40, 3), range(50, 80, 3))]
    calls = []
    generate = judge.engine.generate
    judge.engine.generate = lambda ids, params: calls.append(len(ids)) or generate(ids, params)
    try:
        together = judge(prompts, responses, {})
        alone = [judge([p], [r], {}) for p, r in zip(prompts, responses)]
    finally:
        judge.engine.generate = generate
    assert calls == [len(prompts)] + [1] * len(prompts)   # one engine call for the whole batch
    assert together[1] == [v for _, (v,), _ in alone]
    assert torch.equal(together[0], torch.cat([s for s, _, _ in alone]))


def test_template_columns_and_a_prompt_over_the_length(tmp_path):
    template = tmp_path / "judge.jinja"
    template.write_text("{{ prompt }}{{ response }} vs {{ reference }}")
    made = Judge(judge_config(reward_judge_template=str(template), reward_judge_prompt_length=12))
    assert made.columns == ["reference"]
    made.start(world=1, rank=0)
    scores, verdicts, unreadable = made(["1+1=", "2+2=", "1111111+1111111="], ["2", "4", "2222222"],
                                        {"reference": ["7", "3", "1"]})
    assert verdicts == ["7", "3", ""]          # the column's value is what the judge read last
    assert unreadable == [False, False, True]  # 12 tokens at most: the third prompt is never judged
    assert scores.tolist() == pytest.approx([7 / 9, 3 / 9, 0.0])


# ----------------------------------------------------------------------------------------------
# Config

def test_one_reward_source_and_the_judge_keys_are_checked(tmp_path):
    demo = str(ROOT / "examples" / "demo_model")
    text = message(lambda: validate_config(judge_config(reward_model_path=demo)))
    assert "reward_judge_path" in text and "reward_model_path" in text
    text = message(lambda: validate_config(judge_config(reward_fn="rewards.gsm8k:compute_score")))
    assert "reward_judge_path" in text and "reward_fn=rewards.gsm8k:compute_score" in text
    assert "reward_judge_template" in message(lambda: validate_config(judge_config(reward_judge_template="")))
    assert "reward_judge_engine" in message(lambda: validate_config(judge_config(reward_judge_engine="sglang")))
    no_response = tmp_path / "blind.jinja"
    no_response.write_text("{{ prompt }}")
    assert "never shows the response" in message(lambda: Judge(judge_config(reward_judge_template=str(no_response))))
    assert "reward_judge_parser 'rewards.judge:nope'" in message(
        lambda: Judge(judge_config(reward_judge_parser="rewards.judge:nope")))
    assert "reward_judge_range" in message(lambda: Judge(judge_config(reward_judge_range="9,0")))


def test_dry_run_counts_the_judge(capsys):
    from plumbing.dry_run import dry_run
    for engine, row in (("hf", "judge weights (hf engine)"), ("vllm", "judge: vLLM weights + reward_judge_kv_cache_gb")):
        assert dry_run(judge_config(reward_judge_engine=engine, val_files=""))
        out = capsys.readouterr().out
        assert row in out, out
    dry_run(dataclasses.replace(Config(), val_files=""))
    assert "judge" not in capsys.readouterr().out
    # a reward model on vLLM: its engine's weights and KV cache, not a frozen DeepSpeed copy
    dry_run(dataclasses.replace(Config(), val_files="", reward_model_path=str(ROOT / "examples" / "demo_model"),
                                reward_model_engine="vllm"))
    out = capsys.readouterr().out
    assert "served reward model: vLLM weights + reward_model_kv_cache_gb" in out and "reward model weights" not in out


# ----------------------------------------------------------------------------------------------
# Runs of train_ppo.py with the judge as the only reward

def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_recipe_learns_what_the_vllm_judge_prefers(tmp_path):
    """configs/demo_judge.yaml with the judge on vLLM: the policy's answers move towards ending in
    9, which only the judge rewards. The judge starts near 0.5 (last digits spread evenly) and
    the demo's run reaches 0.9 in 7 steps: 15 smaller steps with a margin of 0.15 leave room."""
    out = tmp_path / "out"
    proc = forkserver.run(
        [sys.executable, str(ROOT / "train_ppo.py"), "--config", str(ROOT / "configs" / "demo_judge.yaml"),
         f"--reward_judge_path={JUDGE}", f"--reward_judge_template={TEMPLATE}",   # cwd: MLflow's artifacts go there
         "--reward_judge_engine=vllm", "--reward_judge_kv_cache_gb=0.1", "--train_batch_size=16",
         "--ppo_mini_batch_size=8", "--total_training_steps=15", "--test_freq=15", "--mlflow_log_model=false",
         f"--output_dir={out}"],
        cwd=tmp_path, env=dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path)), capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = records(out)
    score = {r["step"]: r["reward/score_mean"] for r in steps if "reward/score_mean" in r}
    first, last = sum(score[s] for s in (1, 2, 3)) / 3, sum(score[s] for s in (13, 14, 15)) / 3
    assert last > first + 0.15, score
    assert steps[-1]["val/score_mean"] > steps[0]["val/score_mean"] + 0.15
    assert all(r["reward/judge_parse_errors"] >= 0 for r in steps if r["step"] > 0)
    (table,) = [json.loads(p.read_text()) for p in tmp_path.rglob("samples/step_000015.json")]
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    for row in rows:   # the judge's verdict beside the response it read: its last digit
        assert row["judge"] == (row["response"][-1:] if row["response"][-1:].isdigit() else "?")


WORKER = """
import dataclasses, json, sys, torch
sys.path.insert(0, {root!r})
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from config import Config
from rewards.judge import Judge
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
rank, world = accelerator.process_index, accelerator.num_processes
cfg = dataclasses.replace(Config(), reward_judge_path={judge!r}, reward_judge_template={template!r},
                          reward_judge_range="0,9", reward_judge_max_tokens=1, reward_judge_prompt_length=32,
                          reward_judge_engine="vllm", reward_judge_kv_cache_gb=0.1)
judge = Judge(cfg)
judge.start(world, rank)
# rank 0 scores 5 samples, rank 1 one, then none: the calls line up, the counts do not
out = []
for count in ((5, 1), (3, 0)):
    n = count[rank]
    scores, verdicts, unreadable = judge(["1+1="] * n, [str(10 + 7 * i + rank) for i in range(n)], {{}})
    out.append({{"scores": scores.tolist(), "verdicts": verdicts, "unreadable": unreadable}})
accelerator.wait_for_everyone()
print("RESULT", rank, json.dumps(out), flush=True)
judge.shutdown()
"""


@pytest.mark.slow
def test_two_processes_each_score_their_own_samples(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), judge=str(JUDGE), template=str(TEMPLATE)))
    # the launch train_ppo.py gets under ZeRO-3 with 2 processes (the worker trains nothing)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--main_process_port", str(free_port()), str(script)]
    proc = forkserver.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = {int(line.split()[1]): json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT")}
    assert sorted(results) == [0, 1]
    for rank, calls in results.items():
        for n, call in zip(((5, 1), (3, 0)), calls):
            digits = [str(10 + 7 * i + rank)[-1] for i in range(n[rank])]
            assert call["verdicts"] == digits
            assert call["scores"] == pytest.approx([int(d) / 9 for d in digits])
            assert call["unreadable"] == [False] * n[rank]
