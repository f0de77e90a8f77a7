"""Issue 22's recipes: the CPU tool demo (configs/demo_tools.yaml, examples/demo_tools_model built by
examples/make_demo_tools.py) and the GSM8K + Python-executor config for GPUs, checked by --dry_run on a
config-only copy of Qwen2.5-7B-Instruct (its config.json written out here; no weights, no hub).
The demo's learning run (+20 validation points) is measured in the README, not here.
"""
import json
import math
import os
import sys
from pathlib import Path

import pandas as pd
import pytest

import forkserver
from config import load_config
from mlflow_store import sqlite_uri

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo_tools.yaml"
GPU_CONFIG = ROOT / "configs" / "gsm8k_python_qwen2.5_7b.yaml"
TOOL_KEYS = ["tools/calls_per_sample", "tools/error_rate", "tools/turns_mean", "tools/truncated_rate", "time/tools_s"]


def test_demo_tools_model_data_and_template_load():
    """The committed model's tokenizer passes the chat-template check with the calculator, every prompt
    fits max_prompt_length with the tool schema, and the reward scores a tool conversation."""
    from transformers import AutoTokenizer
    from prompts.sets import load_prompts
    from rewards.arithmetic import final_answer_score
    from rollout.tools.rollouts import make_tool_rollouts
    cfg = load_config(["--config", str(DEMO)])
    tokenizer = AutoTokenizer.from_pretrained(ROOT / cfg.model_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    tools = make_tool_rollouts(cfg, tokenizer)   # runs check_template: raises on a bad template
    assert tools.names == ["calculator"]
    for files, n in ((cfg.train_files, 4000), (cfg.val_files, 200)):
        prompts = load_prompts(str(ROOT / files), cfg.prompt_key, tokenizer, cfg.max_prompt_length, "error",
                               keep_rows=True)
        assert len(prompts.ids) == n
        longest = max(len(tools.prompt_ids(row, text)) for row, text in zip(prompts.rows, prompts.texts))
        assert longest <= cfg.max_prompt_length
    frame = pd.read_parquet(ROOT / cfg.val_files)
    prompt, answer = frame["prompt"][0], frame["answer"][0]
    a, b = prompt.rstrip("=").split("*")
    assert int(a) * int(b) == int(answer) and 100 <= int(a) <= 999 and 10 <= int(b) <= 99
    conversation = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": f"The answer is {answer}."}]
    assert final_answer_score([prompt], [""], [conversation]) == [1.0]


@pytest.fixture(scope="module")
def qwen_7b_config_only(tmp_path_factory):
    """Qwen2.5-7B-Instruct as --dry_run needs it: config.json (the published values) and a tokenizer with
    Qwen2.5's chat template (byte-level, built offline by test_tools); no weights."""
    from test_tools import qwen_style_tokenizer
    path = tmp_path_factory.mktemp("Qwen2.5-7B-Instruct")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "sliding_window": 131072, "max_window_layers": 28, "use_sliding_window": False, "torch_dtype": "bfloat16"}))
    qwen_style_tokenizer().save_pretrained(path)
    return path


def test_gsm8k_python_config_passes_dry_run(qwen_7b_config_only, tmp_path):
    """The GPU recipe's keys resolve, the python tool loads, the template passes, GSM8K-shaped prompts fit
    with the tool's description, and the memory plan for a 7B actor prints (it cannot fit this machine)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import prepare_gsm8k
    rows = pd.DataFrame({"question": [f"Tom has {i} apples and buys 3 more. How many now?" for i in range(130)],
                         "answer": [f"{i} + 3 = {i + 3}\n#### {i + 3}" for i in range(130)]})
    data = prepare_gsm8k.convert(rows, "test")
    data.to_parquet(tmp_path / "train.parquet")
    data[:10].to_parquet(tmp_path / "val.parquet")
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), "--config", str(GPU_CONFIG), "--dry_run",
                           f"--model_path={qwen_7b_config_only}", f"--train_files={tmp_path / 'train.parquet'}",
                           f"--val_files={tmp_path / 'val.parquet'}", f"--output_dir={tmp_path / 'out'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    print(out)
    assert "Traceback" not in out, out[-3000:]
    assert "data: 130 train rows, 10 val rows" in out, out[-3000:]
    assert "tools: python; chat template passes the prefix check" in out, out[-3000:]
    assert "python tool sandbox: bwrap (started once here)" in out, out[-3000:]
    assert "actor: 7615.62M parameters" in out   # read from config.json alone
    assert "memory per rank" in out and "8 ranks" in out


@pytest.mark.slow
def test_demo_tools_runs_and_calls_the_calculator(tmp_path):
    """A short step of the demo: the tools/* metrics are logged, finite, and the policy calls the tool."""
    env = dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path), PYTHONUNBUFFERED="1")
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), "--config", str(DEMO),
                           f"--output_dir={tmp_path / 'out'}", "--total_training_steps=1", "--test_freq=-1",
                           "--val_before_train=false", "--train_batch_size=16", "--ppo_mini_batch_size=16",
                           "--mlflow_log_model=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    for r in records:
        assert not [k for k in TOOL_KEYS if k not in r], r
        assert all(math.isfinite(r[k]) for k in TOOL_KEYS)
        assert r["tools/calls_per_sample"] > 0 and r["tools/error_rate"] < 0.5
    # a call is followed by an answer, so some trajectories take two turns
    assert max(r["tools/turns_mean"] for r in records) > 1


def test_gsm8k_final_turn_reward_ignores_tool_output():
    from rewards.gsm8k import compute_score_final_turn
    user = {"role": "user", "content": "q"}
    call = {"role": "assistant", "content": "<tool_call>...</tool_call>"}
    tool = {"role": "tool", "content": "#### 72"}
    conversations = [[user, call, tool, {"role": "assistant", "content": "So #### 72"}],
                     [user, call, tool],                                          # cut off after the tool
                     [user, call, tool, {"role": "assistant", "content": "#### 71"}]]
    assert compute_score_final_turn(["q"] * 3, ["#### 72"] * 3, ["72"] * 3, conversations) == [1.0, 0.0, 0.0]
