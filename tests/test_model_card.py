"""plumbing/model_card.py on its own: the card's facts read back with huggingface_hub's ModelCard.
The cards of real runs (final/, checkpoints, a LoRA adapter, the registered model version) are
checked in tests/test_e2e.py's runs."""
import hashlib
from importlib.metadata import version

import pandas as pd
from huggingface_hub import ModelCard

from plumbing import model_card

HISTORY = [{"step": 0, "val/accuracy": 0.25, "val/score_mean": 0.25},
           {"step": 1, "reward/score_mean": 0.1},
           {"step": 2, "reward/score_mean": 0.2, "val/accuracy": 0.5, "val/score_mean": 0.5},
           {"step": 3, "reward/score_mean": 0.3, "val/accuracy": 0.375, "val/score_mean": 0.375}]


def config_for(tmp_path, **extra):
    data = tmp_path / "train.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+3="]}).to_parquet(data)
    return {"model_path": "models/base", "train_files": str(data), "val_files": "", "sft_files": "",
            "output_dir": str(tmp_path / "out"), "run_name": "", "adv_estimator": "grpo", "use_kl_in_reward": False,
            "use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001, "lora_rank": 0,
            "reward_fn": "rewards.arithmetic:compute_score", "reward_model_path": "", "total_training_steps": 3, **extra}


def test_the_card_carries_the_runs_facts(tmp_path):
    cfg = config_for(tmp_path)
    path = model_card.write_card(tmp_path / "out" / "final", cfg, HISTORY)
    card = ModelCard.load(path)
    assert card.data.base_model == "models/base" and card.data.library_name == "transformers"
    digest = hashlib.sha256(open(cfg["train_files"], "rb").read()).hexdigest()
    assert f"`{cfg['train_files']}` | `{digest}`" in card.text
    assert "| `val/accuracy` | 0.375 | 0.5 |" in card.text            # final (step 3) and best (step 2)
    assert "final (step 3) | best (step 2)" in card.text
    assert "adv_estimator=grpo" in card.text and "low_var_kl" in card.text
    assert f"transformers {version('transformers')}" in card.text
    assert "![learning curves](../curves.png)" in card.text            # final/ sits in the output directory
    assert "kl_loss_coef: 0.001" in card.text                          # the whole config
    assert model_card.git_commit() in card.text


def test_an_adapter_card_and_a_checkpoint_card_say_what_they_are(tmp_path):
    cfg = config_for(tmp_path, lora_rank=8)
    adapter = ModelCard.load(model_card.write_card(tmp_path / "final", cfg, HISTORY, adapter=True))
    assert adapter.data.library_name == "peft" and "AutoPeftModelForCausalLM" in adapter.text
    assert "LoRA rank 8" in adapter.text
    ckpt = ModelCard.load(model_card.write_card(tmp_path / "out" / "checkpoints" / "step_2", cfg, HISTORY[:3], step=2))
    assert "checkpoint at step 2" in ckpt.text and "resume" in ckpt.text
    assert "![learning curves](../../curves.png)" in ckpt.text


def test_no_validation_is_said_not_left_blank(tmp_path):
    card = ModelCard.load(model_card.write_card(tmp_path / "final", config_for(tmp_path), HISTORY[1:2]))
    assert "No validation ran" in card.text


def test_the_registry_description_keeps_the_facts_within_the_column(tmp_path):
    cfg = config_for(tmp_path)
    text = model_card.write_card(tmp_path / "final", cfg, HISTORY).read_text()
    described = model_card.registry_description(text)
    assert "models/base" in described and "| `val/accuracy` | 0.375 | 0.5 |" in described
    assert "kl_loss_coef: 0.001" not in described and "base_model:" not in described   # no config, no YAML header
    assert len(model_card.registry_description(text, limit=300)) <= 300 < len(described)


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    assert model_card.git_commit(tmp_path) == "unknown"
