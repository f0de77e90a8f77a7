"""Bad input that a library rejects from deep inside (or, worse, accepts) at import, load or
launch time: importing the user's reward module, transformers and PEFT loading, the DeepSpeed
config Accelerate reads, and the launch. Each stops before training with one line that names the
key or file, checked at the boundary where the library is called (in process, on the real
libraries), and end to end where the launcher is part of the story."""
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import pandas as pd
import pytest
import torch

import forkserver
from distribution import plugins as distributed
import config
from modeling import loading
from rewards import scoring
from config import load_config
from errors import UserError
from prompts.sets import load_prompts
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "examples" / "demo_model"


def message(call) -> str:
    with pytest.raises(UserError) as e:
        call()
    text = str(e.value)
    assert "\n" not in text.strip(), text
    return text


def small(**kw) -> config.Config:
    """Only the actor loads: no critic (grpo), no reference (no KL)."""
    return config.Config(**{"adv_estimator": "grpo", "use_kl_in_reward": False, **kw})


def copy_model(tmp_path, *names) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    for name in names:
        shutil.copy(DEMO_MODEL / name, out / name)
    return out


# ---- transformers loading: the tokenizer -------------------------------------------------------
def test_model_directory_without_tokenizer_files_is_named_not_the_prompts(tmp_path):
    """transformers builds an empty tokenizer from config.json's model type, which turned every
    prompt into no tokens: the run reported 'row 0 has an empty prompt'."""
    model = copy_model(tmp_path, "config.json", "model.safetensors", "generation_config.json")
    text = message(lambda: loading.load_models(small(model_path=str(model))))
    assert "model_path" in text and str(model) in text and "tokenizer" in text


def test_prompt_the_vocabulary_does_not_cover_names_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    data = tmp_path / "p.jsonl"
    pd.DataFrame({"prompt": ["1+1=", "你好吗"]}).to_json(data, orient="records", lines=True, force_ascii=False)
    text = message(lambda: load_prompts(str(data), "prompt", AutoTokenizer.from_pretrained(DEMO_MODEL), 16, "error"))
    assert "row 1" in text and "你好吗" in text and "no tokens" in text and "model_path" in text


def tiny_llama(out: Path, vocab_size: int = 64, eos: bool = True) -> Path:
    """A tiny Llama with the demo's character tokenizer (Llama's tokenizer class has no default
    EOS, unlike Qwen2's, so a tokenizer_config.json without one really has none)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from examples.make_demo import build_char_tokenizer
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2,
                                 max_position_embeddings=64)).save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    if not eos:
        conf = json.loads((out / "tokenizer_config.json").read_text())
        conf.pop("eos_token"), conf.pop("pad_token")
        (out / "tokenizer_config.json").write_text(json.dumps(conf))
    return out


def test_tokenizer_without_eos_or_pad_is_refused_at_load(tmp_path):
    """It used to load, then fail inside the first step (torch.full with a None pad id)."""
    model = tiny_llama(tmp_path / "m", eos=False)
    text = message(lambda: loading.load_models(small(model_path=str(model))))
    assert "model_path" in text and str(model) in text and "EOS" in text


def test_tokenizer_whose_class_supplies_another_eos_is_warned_about(tmp_path, capsys):
    """Without eos_token in tokenizer_config.json, Qwen2's tokenizer class adds its own default
    EOS as a new token (id 48 here): the run trained on, responses never ending at the model's
    EOS (id 2), without a word."""
    model = copy_model(tmp_path, "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                       "tokenizer_config.json")
    conf = json.loads((model / "tokenizer_config.json").read_text())
    conf.pop("eos_token"), conf.pop("pad_token")
    (model / "tokenizer_config.json").write_text(json.dumps(conf))
    loading.load_models(small(model_path=str(model)))
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: model_path")]
    assert len(notes) == 1 and "eos_token_id=[2]" in notes[0] and "tokenizer_config.json" in notes[0]
    loading.load_models(small())   # the demo's tokenizer and model agree: no note
    assert "warning: model_path" not in capsys.readouterr().err


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    """48 tokens into 40 embedding rows: an index error inside the first forward pass otherwise."""
    model = tiny_llama(tmp_path / "m", vocab_size=40)
    text = message(lambda: loading.load_models(small(model_path=str(model))))
    assert "vocab_size=40" in text and "48" in text and str(model) in text


def test_sequence_longer_than_the_model_positions_names_the_keys():
    """vLLM refused it naming only its own max_model_len; the demo model has 64 positions."""
    text = message(lambda: loading.load_models(small(max_prompt_length=16, max_response_length=60)))
    assert "max_prompt_length" in text and "max_response_length" in text and "max_position_embeddings=64" in text
    loading.load_models(small(max_prompt_length=16, max_response_length=48))   # 64 fits


# ---- PEFT --------------------------------------------------------------------------------------
def test_lora_target_that_matches_nothing_is_named_even_beside_one_that_does():
    """PEFT silently drops a listed name that matches no module when another name matches."""
    text = message(lambda: loading.load_models(small(lora_rank=4, lora_target_modules="q_proj,qproj")))
    assert "lora_target_modules" in text and "qproj" in text and "q_proj" in text   # names the valid ones too


def test_lora_on_a_module_peft_cannot_wrap_names_the_key():
    text = message(lambda: loading.load_models(small(lora_rank=4, lora_target_modules="norm")))
    assert "lora_target_modules=norm" in text and str(DEMO_MODEL) in text


# ---- the user's reward module ------------------------------------------------------------------
REWARD_MODULES = {
    "syntax_error": ("def score(prompts, responses:\n    return [0.0] * len(prompts)\n", ["SyntaxError", "line 1"]),
    "raises_at_import": ("import os\nraise RuntimeError('needs a GPU')\n", ["RuntimeError", "needs a GPU", "line 2"]),
    "too_few_parameters": ("def score(prompts):\n    return [0.0] * len(prompts)\n", ["prompts, responses"]),
    "not_callable": ("score = 0.5\n", ["0.5", "not a function"]),
    "missing_dependency": ("import no_such_dependency_xyz\n", ["no_such_dependency_xyz", "line 1"]),
}


@pytest.mark.parametrize("case", sorted(REWARD_MODULES))
def test_reward_module_problems_are_one_line_naming_reward_fn(tmp_path, monkeypatch, case):
    source, named = REWARD_MODULES[case]
    module = f"user_reward_{case}_{uuid.uuid4().hex[:8]}"   # a fresh name: no cached import
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = message(lambda: scoring.load_reward_fn(f"{module}:score"))
    assert f"reward_fn '{module}:score'" in text
    for part in named:
        assert part in text
    if case not in ("too_few_parameters", "not_callable"):
        assert str(tmp_path / f"{module}.py") in text   # where it happened


def test_reward_module_in_a_package_that_does_not_exist():
    text = message(lambda: scoring.load_reward_fn("no_such_package_xyz.scores:compute"))
    assert "no_such_package_xyz" in text and "PYTHONPATH" in text


def test_reward_functions_of_the_repository_still_load():
    from rewards import arithmetic, gsm8k
    assert scoring.load_reward_fn("rewards.arithmetic:compute_score") is arithmetic.compute_score
    assert scoring.load_reward_fn("rewards.gsm8k:compute_score") is gsm8k.compute_score


# ---- data files and columns --------------------------------------------------------------------
def test_a_directory_given_as_data_files_is_called_a_directory(tmp_path):
    text = message(lambda: load_config([f"--val_files={tmp_path}"]))
    assert "val_files" in text and "is a directory" in text


def test_a_file_given_as_model_path_is_called_a_file():
    text = message(lambda: load_config([f"--model_path={DEMO_MODEL / 'config.json'}"]))
    assert "model_path" in text and "is a file" in text


def test_prompt_column_of_numbers_names_prompt_key_and_value(tmp_path):
    from transformers import AutoTokenizer
    data = tmp_path / "p.parquet"
    pd.DataFrame({"question": [12345, 2]}).to_parquet(data)
    text = message(lambda: load_prompts(str(data), "question", AutoTokenizer.from_pretrained(DEMO_MODEL), 16, "error"))
    assert "prompt_key" in text and "'question'" in text and "12345" in text and "row 0" in text


# ---- the DeepSpeed config Accelerate reads ------------------------------------------------------
def launched_with(monkeypatch, ds_file) -> str:
    """What reading the launched DeepSpeed config says, as `accelerate launch` sets the process up."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_file))
    return message(lambda: distributed.make_accelerator(False, {"actor": distributed.Role(True, 1, 1.0)}, {}))


def zero3_with(tmp_path, change) -> Path:
    conf = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    change(conf)
    (tmp_path / "ds.json").write_text(json.dumps(conf))
    return tmp_path / "ds.json"


def test_missing_deepspeed_config_file_is_named(tmp_path, monkeypatch):
    """Accelerate reported it as a failed JSON and base64 decode of the path."""
    monkeypatch.chdir(tmp_path)
    text = launched_with(monkeypatch, "ds_configs/zero3.json")   # relative: resolved in the working directory
    assert "deepspeed_config_file ds_configs/zero3.json does not exist" in text and str(tmp_path) in text


def test_deepspeed_config_that_is_not_json_names_file_and_position(tmp_path, monkeypatch):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    text = launched_with(monkeypatch, bad)
    assert str(bad) in text and "not valid JSON" in text and "line 1" in text


@pytest.mark.parametrize("change, named", [
    (lambda c: c["zero_optimization"].update(stage="three"), "zero_optimization.stage='three'"),
    (lambda c: c["zero_optimization"].update(overlap_comm="sometimes"), "zero_optimization.overlap_comm"),
    (lambda c: c.update(zero_optimization=[3]), "zero_optimization must be an object"),
    (lambda c: c.update(bf16=True), "bf16 must be an object"),
])
def test_deepspeed_setting_of_the_wrong_type_is_named(tmp_path, monkeypatch, change, named):
    ds = zero3_with(tmp_path, change)
    text = launched_with(monkeypatch, ds)
    assert str(ds) in text and named in text


def test_repository_deepspeed_configs_still_read(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for name in ("zero2.json", "zero3.json", "zero3_offload.json"):
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs" / name))
        assert distributed.launched_deepspeed_config()["zero_optimization"]["stage"] in (2, 3)


def test_auto_buckets_are_at_least_min_bucket_and_large_models_keep_accelerates_size(tmp_path, monkeypatch):
    """ZeRO's "auto" reduce and prefetch buckets: the demo model's hidden_size^2 (16k elements) is
    raised to MIN_BUCKET, a 2,048-wide model keeps Accelerate's hidden_size^2 and 0.9 of it, a number
    in the file stays, and the persistence threshold (which weights are split) stays Accelerate's."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs" / "zero3.json"))
    base = distributed.launched_deepspeed_config()

    def zero_after(model, conf=base) -> dict:
        plugin = distributed.deepspeed_plugins(conf, {"actor": distributed.Role(True, 4, 1.0)}, 2, False)["actor"]
        distributed.size_buckets(plugin, model)
        return plugin.deepspeed_config["zero_optimization"]
    small = zero_after(AutoModelForCausalLM.from_pretrained(DEMO_MODEL))
    assert small["reduce_bucket_size"] == small["stage3_prefetch_bucket_size"] == distributed.MIN_BUCKET
    assert small["stage3_param_persistence_threshold"] == "auto"
    wide = torch.nn.Module()
    wide.config = Qwen2Config(hidden_size=2048)
    large = zero_after(wide)
    assert (large["reduce_bucket_size"], large["stage3_prefetch_bucket_size"]) == (2048 * 2048, int(0.9 * 2048 * 2048))
    fixed = zero_after(wide, {**base, "zero_optimization": {**base["zero_optimization"], "reduce_bucket_size": 5000}})
    assert fixed["reduce_bucket_size"] == 5000 and fixed["stage3_prefetch_bucket_size"] == int(0.9 * 2048 * 2048)


# ---- end to end: the script prints the one line --------------------------------------------------
def error_lines(proc) -> list[str]:
    assert proc.returncode != 0
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def test_reward_module_raising_at_import_is_one_line_without_traceback(tmp_path):
    (tmp_path / "my_reward.py").write_text("import os\nraise OSError('cannot find the answers file')\n")
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONPATH=str(tmp_path))
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), "--reward_fn=my_reward:score",
                           f"--output_dir={tmp_path}/out", "--total_training_steps=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and "reward_fn 'my_reward:score'" in lines[0] and "cannot find the answers file" in lines[0]


@pytest.mark.slow
def test_launch_with_a_deepspeed_config_file_missing_from_the_working_directory(tmp_path):
    """The repository's accelerate configs name their DeepSpeed JSON relative to the repository
    root: launched from elsewhere, the ranks say so in one line each (the traceback left is
    torch's launcher reporting that its children failed). The first rank to fail makes torch's
    launcher stop the other, which may not have reached its check yet: one line or two, nothing else."""
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    proc = forkserver.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port()), str(ROOT / "train_ppo.py"),
                           f"--output_dir={tmp_path}/out", "--total_training_steps=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    # at most one per rank, and nothing else; the ranks share the launcher's stderr, where two lines
    # written at the same moment can run together (seen under load), so they are counted, not split
    said = "error: the accelerate config's deepspeed_config_file ds_configs/zero3.json does not exist"
    assert proc.stderr.count(said) in (1, 2) and proc.stderr.count("error: ") == proc.stderr.count(said), \
        proc.stderr[-3000:]
    assert 'train_ppo.py", line' not in proc.stderr and 'plugins.py", line' not in proc.stderr


# ---- checkpoints ---------------------------------------------------------------------------------
def test_truncated_checkpoint_file_is_named(tmp_path):
    """torch.load's zip reader failed with a RuntimeError traceback."""
    import torch
    from plumbing import checkpoints
    file = tmp_path / "actor.pt"
    torch.save({"model": torch.nn.Linear(64, 64).state_dict()}, file)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    text = message(lambda: checkpoints.safe_load(file))
    assert str(file) in text and "damaged" in text and "--resume=never" in text


def test_checkpoint_of_another_model_is_named(tmp_path):
    """The same config over a model directory whose weights changed shape: load_state_dict's
    size mismatch named which file does not fit which model."""
    import torch
    from accelerate import Accelerator
    from plumbing import checkpoints
    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
    optim = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
    torch.save({"model": other.state_dict(), "optim": torch.optim.AdamW(other.parameters()).state_dict()},
               tmp_path / "actor.pt")
    state = {"world_size": 1, "schedulers": {"actor": sched.state_dict()}}
    text = message(lambda: checkpoints.load_checkpoint(Accelerator(cpu=True), False, tmp_path, state,
                                                       {"actor": (model, optim, sched)}))
    assert str(tmp_path / "actor.pt") in text and "actor" in text and "size mismatch" in text


# a truncated ZeRO-3 shard, named on every rank: test_distributed.py, on the checkpoints of its
# kill-and-resume reference run
