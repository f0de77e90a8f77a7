"""The GSM8K recipe: scripts/prepare_gsm8k.py, rewards/gsm8k.py and configs/gsm8k_qwen2.5_0.5b.yaml.

GSM8K itself cannot be downloaded here, so the tests write a few rows with its schema (question,
answer ending in "#### <number>", thousands with commas) and check the conversion, the verifier and
that the config and the converted data load through the script's own readers. Expected values are written by hand.
Run from the repo root: python -m pytest tests/test_gsm8k.py -q
"""
import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import prepare_gsm8k  # noqa: E402
import config  # noqa: E402
from prompts import sets  # noqa: E402
from rewards import scoring  # noqa: E402
from rewards.gsm8k import compute_score, compute_score_flexible  # noqa: E402

CONFIG = ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"
SUFFIX = ' Let\'s think step by step and output the final answer after "####".'

TRAIN_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A shop sells 617 pens a day. How many pens does it sell in 2 days?",
     "answer": "It sells 617*2 = <<617*2=1234>>1,234 pens.\n#### 1,234"},
    {"question": "The temperature was 5 degrees and fell by 8 degrees. What is it now?",
     "answer": "5-8 = <<5-8=-3>>-3\n#### -3"},
]
TEST_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "3+4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $12,500 and a bike $1,500. How much do both cost?",
     "answer": "12500+1500 = <<12500+1500=14000>>14000\n#### 14,000"},
]


@pytest.fixture
def gsm8k_files(tmp_path):
    """The train split as parquet (as on the hub), the test split as jsonl (as in the original release)."""
    train, test = tmp_path / "train-00000-of-00001.parquet", tmp_path / "test.jsonl"
    pd.DataFrame(TRAIN_ROWS).to_parquet(train)
    test.write_text("".join(json.dumps(r) + "\n" for r in TEST_ROWS))
    return train, test


# ---- conversion -----------------------------------------------------------------------------------
def test_conversion_writes_prompt_ground_truth_and_keeps_the_fields(gsm8k_files, tmp_path):
    train, test = gsm8k_files
    prepare_gsm8k.main(["--train", str(train), "--test", str(test), "--out", str(tmp_path / "out")])
    out_train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    out_val = pd.read_parquet(tmp_path / "out" / "val.parquet")

    assert list(out_train.columns) == ["prompt", "ground_truth", "question", "answer"]
    assert list(out_train["ground_truth"]) == ["72", "1234", "-3"]
    assert list(out_val["ground_truth"]) == ["7", "14000"]
    assert list(out_train["question"]) == [r["question"] for r in TRAIN_ROWS]
    assert list(out_train["answer"]) == [r["answer"] for r in TRAIN_ROWS]
    messages = list(out_train["prompt"][1])
    assert len(messages) == 1
    assert messages[0]["role"] == "user"
    assert messages[0]["content"] == TRAIN_ROWS[1]["question"] + SUFFIX


def test_converted_prompts_load_through_the_trainer_with_a_chat_template(gsm8k_files, tmp_path):
    from transformers import AutoTokenizer
    train, test = gsm8k_files
    prepare_gsm8k.main(["--train", str(train), "--test", str(test), "--out", str(tmp_path)])
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "demo_model")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    prompts = sets.load_prompts(str(tmp_path / "val.parquet"), "prompt", tokenizer, 10_000, "error",
                                     columns=["ground_truth"], reward_fn="rewards.gsm8k:compute_score")
    texts, ids = prompts.texts, prompts.ids
    assert prompts.columns["ground_truth"] == [TEST_ROWS[0]["answer"].split("####")[-1].strip().replace(",", ""),
                                               TEST_ROWS[1]["answer"].split("####")[-1].strip().replace(",", "")]
    assert texts == ["<user>" + TEST_ROWS[0]["question"] + SUFFIX + "<assistant>",
                     "<user>" + TEST_ROWS[1]["question"] + SUFFIX + "<assistant>"]
    assert len(ids) == 2 and all(ids)


def test_several_files_per_split_are_concatenated(gsm8k_files, tmp_path):
    train, test = gsm8k_files
    prepare_gsm8k.main(["--train", f"{train},{test}", "--test", str(test), "--out", str(tmp_path / "out")])
    assert list(pd.read_parquet(tmp_path / "out" / "train.parquet")["ground_truth"]) == ["72", "1234", "-3", "7", "14000"]


def test_a_missing_column_names_the_file_and_the_column(tmp_path, gsm8k_files):
    _, test = gsm8k_files
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"question": ["q"], "solution": ["#### 1"]}).to_parquet(bad)
    with pytest.raises(SystemExit) as err:
        prepare_gsm8k.main(["--train", str(bad), "--test", str(test), "--out", str(tmp_path / "out")])
    assert str(bad) in str(err.value) and "'answer'" in str(err.value)
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_an_answer_without_the_final_number_names_the_file_and_row(tmp_path, gsm8k_files):
    _, test = gsm8k_files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TRAIN_ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "it is 5"}) + "\n")
    with pytest.raises(SystemExit) as err:
        prepare_gsm8k.main(["--train", str(bad), "--test", str(test), "--out", str(tmp_path / "out")])
    assert str(bad) in str(err.value) and "row 1" in str(err.value)


def test_a_missing_file_and_a_lone_split_are_errors(tmp_path, gsm8k_files):
    train, _ = gsm8k_files
    with pytest.raises(SystemExit) as err:
        prepare_gsm8k.main(["--train", str(train), "--test", str(tmp_path / "nope.parquet"), "--out", str(tmp_path)])
    assert "nope.parquet" in str(err.value)
    with pytest.raises(SystemExit):
        prepare_gsm8k.main(["--train", str(train)])


# ---- verifier -------------------------------------------------------------------------------------
def strict(response, truth):
    return compute_score(["p"], [response], [truth])[0]


def flexible(response, truth):
    return compute_score_flexible(["p"], [response], [truth])[0]


@pytest.mark.parametrize("response, truth, expected", [
    ("48/2 = 24, 48 + 24 = 72.\n#### 72", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("so the answer is 72", "72", 0.0),                 # no "####": strict gives nothing
    ("#### 1,234", "1234", 1.0),
    ("#### 1234", "1,234", 1.0),                        # a ground truth written with commas too
    ("#### $1,234.00", "1234", 1.0),
    ("#### +72", "72", 1.0),
    ("#### 72.", "72", 1.0),
    ("####72", "72", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### 5\nwait, no: 70 + 2\n#### 72", "72", 1.0),   # the last "####" is the answer
    ("#### 72\nactually\n#### 5", "72", 0.0),
    ("#### seventy-two", "72", 0.0),
    ("#### 0.5", "0.50", 1.0),
    ("", "72", 0.0),
])
def test_strict(response, truth, expected):
    assert strict(response, truth) == expected


@pytest.mark.parametrize("response, truth, expected", [
    ("so the answer is 72", "72", 1.0),
    ("so the answer is 72.", "72", 1.0),                # a full stop is not a decimal point
    ("first 5, then 72 apples", "72", 1.0),
    ("72 apples, then 5 left", "72", 0.0),              # the last number counts
    ("#### 72", "72", 1.0),
    ("total: $1,234.0", "1234", 1.0),
    ("the points are 1,2", "2", 1.0),                   # "1,2" is not a thousands group
    ("no number here", "72", 0.0),
    ("it is -3", "-3", 1.0),
])
def test_flexible(response, truth, expected):
    assert flexible(response, truth) == expected


def test_scores_come_in_sample_order():
    responses = ["#### 1", "#### 2", "#### 9", "3"]
    assert compute_score(["a", "b", "c", "d"], responses, ["1", "2", "3", "3"]) == [1.0, 1.0, 0.0, 0.0]
    assert compute_score_flexible(["a", "b", "c", "d"], responses, ["1", "2", "3", "3"]) == [1.0, 1.0, 0.0, 1.0]


def test_both_are_verifiers_and_load_by_name():
    assert compute_score.is_verifier is True and compute_score_flexible.is_verifier is True
    assert scoring.load_reward_fn("rewards.gsm8k:compute_score") is compute_score
    assert scoring.load_reward_fn("rewards.gsm8k:compute_score_flexible") is compute_score_flexible


@pytest.mark.parametrize("fn", [compute_score, compute_score_flexible])
def test_bad_calls_raise(fn):
    with pytest.raises(ValueError, match="ground_truth"):
        fn(["p"], ["#### 1"])                           # the trainer did not pass the column
    with pytest.raises(ValueError):
        fn(["p", "q"], ["#### 1"], ["1", "2"])
    with pytest.raises(ValueError):
        fn(["p"], ["#### 1"], ["1", "2"])
    with pytest.raises(ValueError, match="not a number"):
        fn(["p"], ["#### 1"], ["one"])


# ---- config ---------------------------------------------------------------------------------------
def test_config_uses_only_known_keys():
    keys = set(yaml.safe_load(CONFIG.read_text()))
    assert keys <= {f.name for f in dataclasses.fields(config.Config)}


def test_config_loads_with_the_published_values_next_to_prepared_data(gsm8k_files, tmp_path, monkeypatch):
    """Run from a folder holding the model dir and the prepare script's default output, the config
    loads as it is: its paths and the script's defaults agree."""
    train, test = gsm8k_files
    monkeypatch.chdir(tmp_path)
    prepare_gsm8k.main(["--train", str(train), "--test", str(test)])
    (tmp_path / "models" / "Qwen2.5-0.5B-Instruct").mkdir(parents=True)
    cfg = config.load_config(["--config", str(CONFIG)])

    assert (tmp_path / cfg.train_files).is_file() and (tmp_path / cfg.val_files).is_file()
    assert cfg.model_path == cfg.critic_model_path == "models/Qwen2.5-0.5B-Instruct"
    assert cfg.reward_fn == "rewards.gsm8k:compute_score"
    assert (cfg.clip_ratio, cfg.clip_ratio_c) == (0.2, 3.0)
    assert (cfg.use_kl_loss, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.use_kl_in_reward) == (True, 0.001, "low_var_kl", False)
    assert (cfg.adv_estimator, cfg.gamma, cfg.lam, cfg.ppo_epochs, cfg.max_grad_norm) == ("gae", 1.0, 0.95, 4, 1.0)
    assert (cfg.actor_lr, cfg.critic_lr) == (1e-6, 5e-6)
    assert (cfg.max_prompt_length, cfg.max_response_length) == (1024, 512)
    assert (cfg.train_batch_size, cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_device) == (256, 64, 8)
    assert (cfg.rollout_engine, cfg.rollout_n, cfg.temperature, cfg.dtype, cfg.test_freq) == ("vllm", 1, 1.0, "bf16", 10)
    assert cfg.total_training_steps == 435              # 15 epochs x (7473 // 256 = 29)
    assert cfg.save_freq == 10
