"""Multi-turn tool use in training (issue 22): the tool mask through the real update and advantage
code, and train_ppo.py runs with tools on a tiny Qwen2 that memorised two tool conversations
(tests/test_tools.py's MEMORISED) under Qwen2.5's chat template, single process and 2-process ZeRO-3.
"""
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import forkserver
from config import Config
from mlflow_store import sqlite_uri
from plumbing.oom import OomReaction, base_sizes
from rollout import SamplingParams
from rollout.hf import HFEngine
from rollout.tools import ToolSet
from rollout.tools.rollouts import ToolRollouts
from test_tools import CALC, MEMORISED, call_text, memorise, qwen_style_tokenizer
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_ppo.py"
REWARD = "tests.tool_rewards:answered"   # imported by the run, away from pytest
TOOL_KEYS = ["tools/calls_per_sample", "tools/error_rate", "tools/turns_mean", "tools/truncated_rate", "time/tools_s"]




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The memorised tiny Qwen2 on disk, its tokenizer's pad token = its EOS (<|im_end|>), so every
    turn's end inside a trajectory looks like padding to anything that infers padding from ids."""
    tokenizer = qwen_style_tokenizer()
    chat, model, _ = memorise(tokenizer, ToolSet.from_specs([CALC]), kv_heads=2)   # sp=2 can split it
    path = tmp_path_factory.mktemp("tool_model")
    tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = path / "prompts.jsonl"
    pd.DataFrame({"prompt": [[{"role": "user", "content": q}] for q, _ in MEMORISED]}).to_json(
        data, orient="records", lines=True)
    return path, data, model, tokenizer


def tool_config(**kw):
    return Config(**{"tools": CALC, "max_prompt_length": 1024, "max_response_length": 256, "train_batch_size": 2,
                     "rollout_n": 1, "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 2, "ppo_epochs": 1,
                     **kw})


@pytest.fixture(scope="module")
def rolled_out(model_dir):
    """Two real trajectories (one with a calculator call) from the hf engine, batched as phase 1 does."""
    _, _, model, tokenizer = model_dir
    cfg = tool_config()
    tools = ToolRollouts(cfg, tokenizer)
    prompts = _prompt_set(tokenizer)
    torch.manual_seed(0)
    out = tools.generate(HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id), prompts,
                         SamplingParams(temperature=0.1, max_tokens=cfg.max_response_length))
    return cfg, out, out.batch(tokenizer.pad_token_id)


def _prompt_set(tokenizer):
    from prompts.sets import PromptSet
    messages = [[{"role": "user", "content": q}] for q, _ in MEMORISED]
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    return PromptSet(texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], {},
                     [{"prompt": m} for m in messages])


@pytest.mark.slow
def test_pad_equal_to_eos_keeps_whole_trajectories(rolled_out, model_dir):
    """pad == EOS: the batch covers every token of each trajectory, inner end-of-turn tokens included."""
    _, out, batch = rolled_out
    eos = model_dir[3].eos_token_id
    first = out.trajectories[0]
    assert (first.turns, first.tool_calls, first.stop_reason) == (2, 1, "done")
    inner = [i for i, t in enumerate(first.response_ids[:-1]) if t == eos]
    assert inner, "the first trajectory has an end-of-turn token before its last"
    P = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for row, t in enumerate(out.trajectories):
        assert batch["attention_mask"][row, P:].sum() == len(t.response_ids)
        assert batch["responses"][row, :len(t.response_ids)].tolist() == t.response_ids
        assert batch["response_mask"][row, :len(t.mask)].tolist() == [float(m) for m in t.mask]
        assert batch["response_mask"][row, len(t.mask):].sum() == 0
    assert 0 < batch["response_mask"][0].sum() < len(first.response_ids)   # tool tokens are left out


def test_batch_masks_have_each_trajectorys_length():
    """What the losses see (ToolRolloutOutput.batch): each row's response_mask is the trajectory's mask
    over exactly its tokens and 0 after, when a failed call's error observation overflows the budget
    mid-output, when the model is cut mid-turn, and after failed and malformed calls."""
    from test_tools import HERE, ScriptedEngine, call_text
    tokenizer = qwen_style_tokenizer()
    replies = [[call_text("explode", {"x": "y"}) + '<tool_call>{"name": 1}</tool_call>', "Sorry."],  # two failed calls
               ["x" * 240 + call_text("nope", {}), "never"],       # unknown tool: its error overflows the budget
               ["thinking " * 40 + "..."],                          # cut mid-turn, no EOS
               ["Short."]]
    budget = 320
    cfg = tool_config(tools=f"{CALC},{HERE}:explode", max_response_length=budget, max_prompt_length=2048)
    tools = ToolRollouts(cfg, tokenizer)
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(replies))]
    from prompts.sets import PromptSet
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    engine = ScriptedEngine(tokenizer, replies)
    engine.rows = [tools.chat.prompt_ids(m) for m in prompts]
    out = tools.generate(engine, PromptSet(texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
                                           {}, [{"prompt": m} for m in prompts]), SamplingParams(temperature=1.0))
    trajectories = out.trajectories
    assert [t.stop_reason for t in trajectories] == ["done", "length", "length", "done"]
    assert [(t.tool_calls, t.tool_errors) for t in trajectories] == [(2, 2), (1, 1), (0, 0), (0, 0)]
    overflow = trajectories[1]
    assert len(overflow.response_ids) == budget and overflow.mask[-1] == 0             # cut inside the observation
    assert "error: unknown tool" in tokenizer.decode(overflow.response_ids)
    assert len(trajectories[2].response_ids) == budget and all(trajectories[2].mask)    # cut inside the model's turn
    batch = out.batch(tokenizer.pad_token_id)
    R = batch["responses"].shape[1]
    assert R == budget
    for row, t in enumerate(trajectories):
        n = len(t.response_ids)
        assert len(t.mask) == len(t.logprobs) == n
        assert batch["attention_mask"][row, -R:].sum() == n
        assert batch["responses"][row, :n].tolist() == t.response_ids
        assert batch["response_mask"][row].tolist() == [float(m) for m in t.mask] + [0.0] * (R - n)
        assert out.logprobs[row] == t.logprobs and len(out.logprobs[row]) == n
    assert out.truncated.tolist() == [False, True, True, False]


def _actor_update(model, batch, cfg):
    """One real update_actor pass (policy loss, KL loss, entropy bonus) -> the gradient of every parameter."""
    from accelerate import Accelerator
    from contextlib import nullcontext
    import train_ppo
    model = copy.deepcopy(model).train()
    grads = {}
    optim = torch.optim.SGD(model.parameters(), lr=0.0)
    original_step = optim.step

    def keep_grads(*a, **k):   # the gradients as the optimizer sees them, after clipping
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return original_step(*a, **k)
    optim.step = keep_grads
    accelerator = Accelerator(cpu=True)
    train_ppo.update_actor(accelerator, model, optim, batch, cfg, nullcontext, False, temperature=1.0,
                           entropy_coeff=0.01, oom=OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries),
                           max_grad_norm=cfg.max_grad_norm)
    return grads


def _critic_update(critic, batch, cfg):
    """One real update_critic pass (the value loss, clipped) -> the gradient of every parameter."""
    from accelerate import Accelerator
    from contextlib import nullcontext
    import train_ppo
    critic = copy.deepcopy(critic).train()
    grads = {}
    optim = torch.optim.SGD(critic.parameters(), lr=0.0)
    original_step = optim.step

    def keep_grads(*a, **k):
        grads.update({n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None})
        return original_step(*a, **k)
    optim.step = keep_grads
    accelerator = Accelerator(cpu=True)
    train_ppo.update_critic(accelerator, critic, optim, batch, cfg, nullcontext, False,
                            oom=OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries))
    return grads


@pytest.mark.slow
def test_tool_tokens_get_no_gradient_in_the_update(rolled_out, model_dir):
    """Garbage at tool tokens (advantages, old and ref log-probs, importance weights) changes no
    gradient of the real update; the same garbage at one model token does."""
    cfg, out, batch = rolled_out
    cfg = tool_config(use_kl_loss=True, max_grad_norm=1e9)
    model = model_dir[2]
    R = batch["responses"].shape[1]
    torch.manual_seed(1)
    batch.update(old_logprob=-torch.rand(2, R), ref_logprob=-torch.rand(2, R), advantages=torch.randn(2, R),
                 is_weights=torch.rand(2, R) + 0.5)
    tool_tokens = (batch["response_mask"] == 0) & (batch["attention_mask"][:, -R:] == 1)            # [2, R]
    assert tool_tokens.sum() > 10

    def spoiled(where):
        b = {k: v.clone() for k, v in batch.items()}
        for key in ("old_logprob", "ref_logprob", "advantages", "is_weights"):
            b[key][where] = 1e3
        return b

    clean = _actor_update(model, batch, cfg)
    at_tools = _actor_update(model, spoiled(tool_tokens), cfg)
    assert clean and all(torch.equal(clean[n], at_tools[n]) for n in clean)
    model_token = torch.zeros_like(tool_tokens)
    model_token[0, 0] = True
    at_model = _actor_update(model, spoiled(model_token), cfg)
    assert any(not torch.equal(clean[n], at_model[n]) for n in clean)


@pytest.mark.slow
def test_tool_tokens_get_no_gradient_in_the_critic_update(rolled_out, model_dir):
    """The real update_critic (value loss with value clipping) on the critic as phase 5 trains it (the
    actor's weights with a value head): garbage returns and old values at tool tokens change no
    gradient; the same garbage at one model token does."""
    from modeling.value_models import load_value_model
    cfg, out, batch = rolled_out
    cfg = tool_config(cliprange_value=0.2, critic_max_grad_norm=1e9)
    critic, _ = load_value_model(str(model_dir[0]), dtype=torch.float32)
    critic.config.pad_token_id = model_dir[3].pad_token_id
    R = batch["responses"].shape[1]
    torch.manual_seed(3)
    batch = {**batch, "returns": torch.randn(2, R), "values": torch.randn(2, R)}
    tool_tokens = (batch["response_mask"] == 0) & (batch["attention_mask"][:, -R:] == 1)            # [2, R]
    assert tool_tokens.sum() > 10

    def spoiled(where):
        b = {k: v.clone() for k, v in batch.items()}
        for key in ("returns", "values"):
            b[key][where] = 1e3
        return b

    clean = _critic_update(critic, batch, cfg)
    at_tools = _critic_update(critic, spoiled(tool_tokens), cfg)
    assert clean and all(torch.equal(clean[n], at_tools[n]) for n in clean)
    model_token = torch.zeros_like(tool_tokens)
    model_token[0, 0] = True
    at_model = _critic_update(critic, spoiled(model_token), cfg)
    assert any(not torch.equal(clean[n], at_model[n]) for n in clean)


@pytest.mark.slow
def test_tool_tokens_carry_no_reward_kl_or_advantage(rolled_out):
    """Phase 4 (KL in the reward, GAE): the values, log-probs and rewards at tool tokens do not move a
    model token's advantage, and the score sits on the last model token."""
    from accelerate import Accelerator
    import kl
    import train_ppo
    from core_algos import place_scores
    cfg, out, batch = rolled_out
    R = batch["responses"].shape[1]
    mask = batch["response_mask"]
    scores = place_scores(torch.tensor([1.0, 0.5]), mask, "last", 1.0)                             # [2, R]
    for row in range(2):
        last_model = max(i for i, m in enumerate(out.trajectories[row].mask) if m)
        assert scores[row].nonzero().flatten().tolist() == [last_model]
    tool_tokens = (mask == 0) & (batch["attention_mask"][:, -R:] == 1)
    torch.manual_seed(2)
    base = dict(old_logprob=-torch.rand(2, R), ref_logprob=-torch.rand(2, R), values=torch.randn(2, R),
                old_entropy=torch.rand(2, R))

    def advantages(spoil):
        b = {**batch, **{k: v.clone() for k, v in base.items()}}
        if spoil:
            for key in base:
                b[key][tool_tokens] = 1e3
        metrics = train_ppo.rewards_and_advantages(tool_config(kl_coef=0.1), Accelerator(cpu=True),
                                                   kl.make_kl_controller("fixed", 0.1, 0.1, 10000), b, scores,
                                                   torch.arange(2), torch.ones(2, dtype=torch.bool))
        return b["advantages"], b["returns"], metrics["actor/entropy"]

    (adv, ret, entropy), (adv_spoiled, ret_spoiled, entropy_spoiled) = advantages(False), advantages(True)
    assert torch.allclose(adv[mask > 0], adv_spoiled[mask > 0]) and torch.allclose(ret[mask > 0], ret_spoiled[mask > 0])
    assert entropy == pytest.approx(entropy_spoiled, rel=1e-6) and 0 < entropy < 1   # the tool tokens' entropy counts nowhere
    assert adv[mask > 0].abs().sum() > 0


def run_args(model_path, data, out, *extra):
    return [f"--model_path={model_path}", f"--train_files={data}", f"--val_files={data}", f"--output_dir={out}",
            f"--tools={CALC}", f"--reward_fn={REWARD}", "--max_prompt_length=1024", "--max_response_length=256",
            "--temperature=0.1", "--train_batch_size=2", "--rollout_n=2", "--ppo_mini_batch_size=2",
            "--ppo_micro_batch_size_per_device=4", "--ppo_epochs=1", "--total_training_steps=2", "--test_freq=2",
            "--actor_lr=1e-5", "--critic_lr=1e-5", "--mlflow_log_model=false", *extra]


def check_tool_metrics(out, steps=(0, 1, 2)):
    """steps: those logged (0: the validation before training); the last one validates."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(steps)
    for r in records[1 if steps[0] == 0 else 0:]:
        missing = [k for k in TOOL_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        bad = {k: v for k, v in r.items() if not math.isfinite(v)}
        assert not bad, f"step {r['step']} has non-finite {bad}"
        # one prompt of two calls the calculator: a half call and 1.5 turns per sample, no error
        assert r["tools/calls_per_sample"] == pytest.approx(0.5)
        assert r["tools/turns_mean"] == pytest.approx(1.5)
        assert r["tools/error_rate"] == 0 and r["tools/truncated_rate"] == 0
        assert r["reward/accuracy"] == pytest.approx(1.0)
    assert records[-1]["val/accuracy"] == pytest.approx(1.0)   # greedy validation runs the tool too
    return records


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_train_with_the_calculator(model_dir, tmp_path, engine):
    """A short run with the calculator on either engine; the sampler's log-probs line up with the
    actor's at the model tokens (rollout/logprob_diff of fp32 rounding, tool tokens left out)."""
    model_path, data, _, _ = model_dir
    env = dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path), PYTHONUNBUFFERED="1")
    proc = forkserver.run([sys.executable, str(SCRIPT), *run_args(model_path, data, tmp_path / "out"),
                           f"--rollout_engine={engine}", "--rollout_is=token"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = check_tool_metrics(tmp_path / "out")
    for r in records[1:]:
        assert r["rollout/logprob_diff"] < 1e-3
    print({k: records[1][k] for k in TOOL_KEYS + ["rollout/logprob_diff"]})


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2])
def test_zero3_two_processes_with_skewed_turns(model_dir, tmp_path, sp):
    """The step gives one rank the calculator prompt (2 turns) and the other "Say hi." (1 turn), and so
    does the greedy validation after it: the rank that finishes first runs filler passes, so ZeRO-3's
    gathered generation does not hang. sp=2: the two ranks are one sequence-parallel group of those two
    prompts; each runs one trajectory and its tool calls, and both train on both trajectories. The
    validation set is the calculator prompt alone: with sp=2 one rank of the group has no share and
    runs filler passes only; with 2 data-parallel ranks the second repeats it (not counted)."""
    model_path, data, _, _ = model_dir
    val = tmp_path / "val.jsonl"
    val.write_text(data.read_text().splitlines()[0] + "\n")   # "What is 6*7?"
    assert "6*7" in val.read_text()
    calls = tmp_path / "calls.log"
    env = dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path), PYTHONUNBUFFERED="1", TOOL_CALL_LOG=str(calls))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--main_process_port", str(free_port()),
           str(SCRIPT), *run_args(model_path, data, tmp_path / "out", "--rollout_n=1", "--total_training_steps=1",
                                  "--test_freq=1", "--val_before_train=false", "--tools=tests.tool_rewards:calculator",
                                  f"--val_files={val}",
                                  f"--ulysses_sequence_parallel_size={sp}")]
    proc = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    check_tool_metrics(tmp_path / "out", steps=(1,))
    # the calculator prompt's one call in the step and one in the validation, each run by one rank
    # (sp=1: and the second data-parallel rank's repeat of the validation prompt)
    assert len(calls.read_text().splitlines()) == {1: 3, 2: 2}[sp], calls.read_text()


def test_tools_and_environment_are_exclusive():
    from config import load_config
    from errors import UserError
    with pytest.raises(UserError, match="set tools or environment, not both"):
        load_config([f"--tools={CALC}", "--environment=tests.test_tools:CountdownEnv"])
    with pytest.raises(UserError, match="max_turns must be > 0"):
        load_config([f"--tools={CALC}", "--max_turns=0"])


def test_final_answer_score_reads_the_last_assistant_turn():
    from rewards.arithmetic import final_answer_score
    user = {"role": "user", "content": "47*38="}
    call = {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*38"}}\n</tool_call>'}
    tool = {"role": "tool", "content": "1786"}
    assert final_answer_score(["p"] * 4, ["r"] * 4, [
        [user, call, tool, {"role": "assistant", "content": "47*38 = 1786"}],
        [user, call, tool, {"role": "assistant", "content": "It is 1785."}],
        [user, call],                 # ended on a call (max_turns): no answer
        [user, call, tool]]) == [1.0, 0.0, 0.0, 0.0]


# --- runaway code and kills, with the python executor ---------------------------------------------

PYTHON = "rollout.tools.builtin:python"
# Only the hang meets the clock. The flood meets the output limit and the growth the memory limit
# (its first GiB is past 512 MB: refused at once, without touching memory that a loaded machine
# could take longer to fill than the timeout), so their errors never depend on the machine's load.
RUNAWAY = [("Hang.", [call_text("python", {"code": "import time\ntime.sleep(3600)"})]),
           ("Flood.", [call_text("python", {"code": "while True:\n    print('x' * 1000)"})]),
           ("Grow.", [call_text("python", {"code": "x = []\nwhile True:\n    x.append(bytearray(2**30))"})])]


@pytest.fixture(scope="module")
def runaway_dir(tmp_path_factory):
    """A tiny Qwen2 that holds one python call per prompt: code that sleeps forever, prints without
    end, or allocates without bound (what comes after the tool's answer it never learnt); the runs
    below keep its weights still."""
    tokenizer = qwen_style_tokenizer()
    _, model, _ = memorise(tokenizer, ToolSet.from_specs([PYTHON]), RUNAWAY)
    path = tmp_path_factory.mktemp("runaway_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = path / "prompts.jsonl"
    pd.DataFrame({"prompt": [[{"role": "user", "content": q}] for q, _ in RUNAWAY]}).to_json(
        data, orient="records", lines=True)
    return path, data


def runaway_args(model_path, data, out, *extra):
    return [f"--model_path={model_path}", f"--train_files={data}", f"--output_dir={out}", f"--tools={PYTHON}",
            f"--reward_fn={REWARD}", "--max_prompt_length=1024", "--max_response_length=512", "--max_turns=2",
            "--tool_timeout_s=3", "--train_batch_size=3", "--rollout_n=1", "--ppo_mini_batch_size=3",
            "--ppo_micro_batch_size_per_device=3", "--ppo_epochs=1", "--val_before_train=false", f"--val_files={data}",
            "--actor_lr=1e-5", "--critic_lr=1e-5", "--mlflow_log_model=false", *extra]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_runaway_tool_code_is_stopped_and_the_run_goes_on(runaway_dir, tmp_path):
    """train_ppo.py with the python tool and a model that writes a hang, a flood of output and an
    unbounded allocation: each is stopped (wall clock, output and memory limits), read by the model as
    an error, counted in tools/error_rate, and the run finishes its steps."""
    model_path, data = runaway_dir
    env = dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path), PYTHONUNBUFFERED="1")
    # weights that do not move: the constructed model's LM head is solved by least squares, far from any
    # optimiser's, and one Adam step of 1e-5 on every weight already loses the calls; what is tested here
    # is the tool's limits, not learning
    proc = forkserver.run([sys.executable, str(SCRIPT), *runaway_args(model_path, data, tmp_path / "out"),
                           "--total_training_steps=2", "--test_freq=2", "--temperature=0.1", "--actor_lr=1e-12"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = _records(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["tools/calls_per_sample"] >= 1 and r["tools/error_rate"] > 0, r
        assert all(math.isfinite(v) for v in r.values())
    # what the model read, from the validation samples the run logged to MLflow: the hang killed on
    # the clock, the allocation stopped by the memory limit, the flood by the output cap (its message
    # comes before its output)
    (table,) = [json.loads(p.read_text()) for p in tmp_path.rglob("samples/step_000002.json")]
    text = "".join(row[table["columns"].index("response")] for row in table["data"])
    for words in ("timed out after 3 s and was killed", "MemoryError",
                  "output exceeded 16384 bytes and the program was stopped\nxxxxxxxx"):
        assert words in text, f"no {words!r} in the run's samples"
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=sqlite_uri(tmp_path))
    (logged,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert logged.data.tags["tool_sandbox"] == "bwrap"   # how the tool's code ran, on the run's record


@pytest.mark.slow
def test_sigkill_then_resume_with_tools_matches_the_uninterrupted_run(runaway_dir, tmp_path):
    """tests/test_resume.py's kill, with the python tool: sampled at temperature 0.7 (the trajectories
    vary and depend on the restored RNG), the tool's outputs (errors included) are deterministic given
    the code, so the resumed run logs the uninterrupted run's numbers, step for step, exactly.
    Deterministic given the code only where no outcome hinges on the clock: the flood and the growth
    (stopped by the output and memory limits), not the hang, and a timeout of 30 s, far past the
    time any code sampled from them runs before a limit stops it."""
    import random
    import signal
    import time
    model_path, _ = runaway_dir
    data = tmp_path / "limited.jsonl"
    pd.DataFrame({"prompt": [[{"role": "user", "content": q}] for q, _ in RUNAWAY if q != "Hang."]}).to_json(
        data, orient="records", lines=True)
    extra = ["--total_training_steps=2", "--save_freq=1", "--save_total_limit=2", "--test_freq=-1",
             "--temperature=0.7", "--tool_timeout_s=30", "--train_batch_size=2", "--ppo_mini_batch_size=2",
             "--ppo_micro_batch_size_per_device=2"]

    def command(out):
        return [sys.executable, str(SCRIPT), *runaway_args(model_path, data, out, *extra)]

    def comparable(out):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in _records(out)]

    env = dict(os.environ, MLFLOW_TRACKING_URI=sqlite_uri(tmp_path), PYTHONUNBUFFERED="1")
    reference = forkserver.run(command(tmp_path / "ref"), cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=900)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "out"
    proc = forkserver.Popen(command(out), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    # step 1's checkpoint in place (it is written after step 1's metrics line: on a loaded machine a kill
    # right after that line can come before it, and the run then starts over instead of resuming)
    while not (out / "checkpoints" / "step_1").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(os.getpid()).uniform(0, 1.5))   # somewhere in step 2: rollout, tools or update
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill"
    resumed = forkserver.run(command(out), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    got, want = comparable(out), comparable(tmp_path / "ref")
    assert [r["step"] for r in got] == [1, 2]
    assert any(r["tools/error_rate"] > 0 for r in want)
    assert got == want
