"""The SFT mix (sft_files, InstructGPT's PPO-ptx): supervised data in the actor update keeps the
policy closer to what it was taught. Real runs of train_ppo.py on the demo model (CPU)."""
import json

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.make_demo import make_splits
from test_e2e import DEMO_MODEL, FAST, read_metrics, run


def greedy_answers(prompts: list[str]) -> list[str]:
    """What the warm-started demo model was taught to say: its own greedy answers."""
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    ids = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    return [a.strip() for a in tok.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)]


def held_back_nll(model_dir, prompts: list[str], answers: list[str]) -> float:
    """Mean next-token NLL of answer + EOS after each prompt (teacher forcing)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    for prompt, answer in zip(prompts, answers):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logp = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].log_softmax(-1)
        total -= logp[torch.arange(len(r)), torch.tensor(r)].sum().item()
        count += len(r)
    return total / count


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    _, dev, _ = make_splits()          # prompts neither PPO nor validation uses
    prompts = [f"{a}+{b}=" for a, b in dev[:96]]
    answers = greedy_answers(prompts)
    pd.DataFrame({"prompt": prompts[:64], "response": answers[:64]}).to_parquet(tmp / "sft.parquet")
    return tmp / "sft.parquet", prompts[64:], answers[64:]


@pytest.mark.slow
def test_sft_mix_keeps_the_policy_closer_to_its_supervised_data(tmp_path, sft_data):
    path, held_prompts, held_answers = sft_data
    # 5 steps of one epoch: at actor_lr=2e-4 the held-back NLL drifted 1.9 / 2.2 / 2.1 nats per
    # token after 5 / 10 / 20 plain steps and 0.60 / 0.24 / 0.20 with the mix (a run of each)
    steps = ["--total_training_steps=5", "--test_freq=-1", "--val_before_train=false", "--actor_lr=2e-4", *FAST,
             "--ppo_epochs=1"]
    plain = run(tmp_path, f"--output_dir={tmp_path}/plain", *steps)
    mixed = run(tmp_path, f"--output_dir={tmp_path}/mixed", *steps, f"--sft_files={path}", "--sft_coef=1.0",
                "--sft_batch_size=8")
    assert plain.returncode == 0 and mixed.returncode == 0, plain.stderr[-2000:] + mixed.stderr[-2000:]
    records = read_metrics(tmp_path / "mixed")
    assert all("actor/sft_loss" in r for r in records)
    assert "actor/sft_loss" not in read_metrics(tmp_path / "plain")[0]
    start = held_back_nll(DEMO_MODEL, held_prompts, held_answers)
    drift_plain = abs(held_back_nll(tmp_path / "plain" / "final", held_prompts, held_answers) - start)
    drift_mixed = abs(held_back_nll(tmp_path / "mixed" / "final", held_prompts, held_answers) - start)
    assert drift_mixed < drift_plain, (start, drift_plain, drift_mixed)


def test_sft_file_without_the_response_column_is_named(tmp_path):
    bad = tmp_path / "sft.jsonl"
    bad.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    proc = run(tmp_path, f"--output_dir={tmp_path}/out", f"--sft_files={bad}", "--total_training_steps=1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and str(bad) in line[0] and "'response'" in line[0] and "sft_response_key" in line[0]
