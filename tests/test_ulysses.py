"""Ulysses sequence parallelism (forward/ulysses.py, DeepSpeed's ALST): the split pass equals the
unsplit one, and what cannot work is refused in one line naming the key."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from config import Config, validate_config
from distribution.prepare import check_world_size
from errors import UserError
from forward import packing, ulysses
from forward.batch import pack_batch
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def tiny(heads=4, kv=2, attn="sdpa"):
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv, attn_implementation=attn)
    return Qwen2ForCausalLM(config)


def test_config_refuses_what_cannot_split():
    with pytest.raises(UserError, match=r"ulysses_sequence_parallel_size must be >= 1"):
        validate_config(Config(ulysses_sequence_parallel_size=0))
    with pytest.raises(UserError, match=r"ulysses_sequence_parallel_size=2 .*remove_padding=true"):
        validate_config(Config(ulysses_sequence_parallel_size=2, remove_padding=False))
    with pytest.raises(UserError, match=r"ulysses_sequence_parallel_size=2 does not divide the 3 processes"):
        check_world_size(Config(ulysses_sequence_parallel_size=2, train_batch_size=6, ppo_mini_batch_size=6), 3)
    # until train_ppo.py calls the split passes, a run with it is refused rather than run unsplit
    with pytest.raises(UserError, match=r"ulysses_sequence_parallel_size=2: train_ppo.py does not run"):
        check_world_size(Config(ulysses_sequence_parallel_size=2), 2)
    check_world_size(Config(), 2)


def test_models_that_cannot_split_are_named():
    model = tiny(heads=4, kv=2)
    model.set_attn_implementation(packing.register())
    assert ulysses.unsupported(model, 2) is None
    assert "4 attention heads and 2 key-value heads" in ulysses.unsupported(model, 4)
    assert "attention heads" in ulysses.unsupported(tiny(heads=6, kv=6), 4)
    assert "'sdpa'" in ulysses.unsupported(tiny(), 2)          # padded SDPA: the rows are not packed
    assert "'eager'" in ulysses.unsupported(tiny(attn="eager"), 2)


def test_a_row_splits_into_equal_parts_with_the_row_boundaries():
    batch = pack_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]], pad_id=0)   # 5 + 5 = 10 tokens
    packed = packing.pack(batch)
    parts = [ulysses.Part(packed, 4, r) for r in range(4)]                         # 10 -> 12: 3 each
    assert [p.length for p in parts] == [3, 3, 3, 3]
    assert torch.cat([p.input_ids for p in parts], 1)[0].tolist() == [5, 6, 7, 9, 10, 8, 11, 12, 13, 14, 0, 0]
    assert torch.cat([p.position_ids for p in parts], 1)[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert parts[2].cu_seqlens.tolist() == [0, 5, 10, 12]
    owners = torch.stack([p.mine(packed.response_index.reshape(-1)) for p in parts]).int()   # [4, B * R]
    assert owners.sum(0).tolist() == [1] * packed.response_index.numel()         # each position one rank's


@pytest.mark.slow
def test_two_ranks_split_equal_one_unsplit(tmp_path):
    """2 processes, sp=2, GQA (4 heads, 2 key-value heads), a packed row of 5 sequences padded to
    an even length: log-probs, entropy, top-k/top-p log-probs, gradients and a ZeRO-3 step's
    weights against the unsplit pass (tests/ulysses_worker.py)."""
    out = tmp_path / "figures.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(ROOT / "tests" / "ulysses_worker.py"),
           str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    f = json.loads(out.read_text())
    for key in ("logprob", "entropy", "truncated", "zero3_logprob", "zero3_entropy", "zero3_truncated", "zero3_loss"):
        assert f[key] < 1e-5, (key, f)
    assert f["grad_relative"] < 1e-5 and f["zero3_grad_relative"] < 1e-5, f
    assert f["zero3_weights"] < 1e-5 < f["weights_moved"], f
    # the test can fail: each rank attending only within its own half of the row is far off
    assert f["without_all_to_all"] > 1e-2, f


def test_a_model_whose_heads_do_not_split_is_refused_at_load(tmp_path):
    from modeling import loading
    from test_bad_input_sources import tiny_llama
    model = tiny_llama(tmp_path / "m")                    # 2 attention heads, 2 key-value heads
    cfg = Config(adv_estimator="grpo", use_kl_in_reward=False, model_path=str(model), ulysses_sequence_parallel_size=4)
    with pytest.raises(UserError) as e:
        loading.load_models(cfg)
    text = str(e.value)
    assert "\n" not in text and "ulysses_sequence_parallel_size=4: model_path cannot be split" in text, text
    assert "2 attention heads and 2 key-value heads" in text, text
    loading.load_models(Config(adv_estimator="grpo", use_kl_in_reward=False, model_path=str(model),
                               ulysses_sequence_parallel_size=2))
