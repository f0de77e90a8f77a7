"""--dry_run: the config resolved, files and model configs read (no weights), and a per-rank
memory estimate, checked against the measured peak of a real CPU run."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from ports import free_port

import forkserver

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
DEMO = ROOT / "examples" / "demo_model"


def run(tmp, *args, launcher=(), cwd=None):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", PYTHONUNBUFFERED="1")
    return forkserver.run([sys.executable, *launcher, str(SCRIPT), *args], cwd=cwd or tmp, env=env,
                          capture_output=True, text=True, timeout=900)


def peak_row(stdout: str) -> list[float]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("peak, "))
    return [float(x) for x in line.split()[3:]]


@pytest.mark.slow
def test_dry_run_estimate_is_within_a_factor_of_1_5_of_a_real_run(tmp_path):
    """A 22M-parameter model (32k vocabulary), so model states, not libraries, make most of the
    peak: the estimated peak per rank must be within 1.5x of the measured peak RSS either way."""
    from examples.make_demo import build_char_tokenizer, build_tiny_qwen2
    model = tmp_path / "model"
    build_tiny_qwen2(vocab_size=32768, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                     num_attention_heads=6, num_key_value_heads=2).save_pretrained(model)
    build_char_tokenizer().save_pretrained(model)
    args = [f"--model_path={model}", "--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8",
            "--ppo_micro_batch_size_per_device=16", "--total_training_steps=2", "--test_freq=-1",
            f"--output_dir={tmp_path}/out"]
    dry = run(tmp_path, *args, "--dry_run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()   # nothing trained or written
    assert "22.03M parameters" in dry.stdout and "fits:" in dry.stdout
    estimate = peak_row(dry.stdout)[0]
    real = run(tmp_path, *args)
    assert real.returncode == 0, real.stderr[-3000:]
    measured = float(re.search(r"peak memory of this process ([\d.]+) GiB", real.stdout).group(1))
    assert 1 / 1.5 <= estimate / measured <= 1.5, (estimate, measured)


def qwen25_05b(tmp_path) -> Path:
    """Qwen2.5-0.5B-Instruct's published config (no weights: --dry_run reads configs only), with
    the demo's tokenizer given a chat template."""
    path = tmp_path / "Qwen2.5-0.5B-Instruct"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, path / f)
    conf = json.loads((path / "tokenizer_config.json").read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(conf))
    return path


@pytest.mark.slow
def test_dry_run_on_the_gsm8k_config_under_zero3_prints_tables_for_1_and_8_ranks(tmp_path):
    model = qwen25_05b(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"what is {i}+{i}? #### "}], "ground_truth": str(2 * i)}
            for i in range(300)]
    for split in ("train", "val"):
        pd.DataFrame(rows).to_parquet(tmp_path / f"{split}.parquet")
    launcher = ["-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / "zero3.yaml"),
                "--num_processes", "1", "--main_process_port", str(free_port())]
    proc = run(tmp_path, "--config", str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"), f"--model_path={model}",
               f"--critic_model_path={model}", f"--train_files={tmp_path}/train.parquet",
               f"--val_files={tmp_path}/val.parquet", "--dry_run", launcher=launcher,
               cwd=ROOT)   # the accelerate config names its DeepSpeed JSON relative to the repository
    assert proc.returncode in (0, 1) and "error:" not in proc.stderr, proc.stderr[-3000:]   # 1: does not fit here
    out = proc.stdout
    assert "494.03M parameters" in out and "ZeRO-3" in out and "bf16" in out
    header = next(ln for ln in out.splitlines() if "1 rank" in ln)
    assert "8 ranks" in header
    optim = next(ln for ln in out.splitlines() if ln.startswith("actor optimizer states"))
    one, eight = [float(x) for x in optim.split()[-2:]]
    assert abs(one / eight - 8) < 0.1   # ZeRO-3 shards optimizer states over the ranks
    assert ("fits:" in out) != ("does not fit" in out)


def test_dry_run_that_does_not_fit_names_the_keys_to_change(tmp_path):
    """Responses of 60,000 tokens in micro-batches of 128: the activations cannot fit in any
    machine's memory; the dry run exits 1 and says which keys shrink them."""
    proc = run(tmp_path, "--max_response_length=60000", "--dry_run")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "does not fit" in proc.stdout
    advice = [ln for ln in proc.stdout.splitlines() if ln.startswith("  - ")]
    assert advice and "activations" in advice[0]
    assert "gradient_checkpointing=true" in advice[0] and "ppo_micro_batch_size_per_device" in advice[0]
