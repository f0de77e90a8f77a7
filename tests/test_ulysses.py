"""Ulysses sequence parallelism (forward/ulysses.py, DeepSpeed's ALST): the split pass equals the
unsplit one, and what cannot work is refused in one line naming the key."""
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import forkserver
import model_registry
from config import Config, validate_config
from distribution.prepare import check_world_size
from errors import UserError
from forward import packing, ulysses
from forward.batch import pack_batch
from mlflow_store import sqlite_uri
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
    # batch sizes split over the data-parallel ranks: world / sp
    with pytest.raises(UserError, match=r"train_batch_size=3 is not divisible by the 2 data-parallel ranks \(4 "
                                        r"processes / ulysses_sequence_parallel_size=2\)"):
        check_world_size(Config(ulysses_sequence_parallel_size=2, train_batch_size=3, ppo_mini_batch_size=3), 4)
    check_world_size(Config(ulysses_sequence_parallel_size=2, train_batch_size=3, ppo_mini_batch_size=3), 2)
    with pytest.raises(UserError, match=r"rollout_tensor_model_parallel_size=2 and ulysses_sequence_parallel_size=3: "
                                        r"one must divide the other"):
        check_world_size(Config(ulysses_sequence_parallel_size=3, rollout_tensor_model_parallel_size=2,
                                rollout_engine="vllm", train_batch_size=2, ppo_mini_batch_size=2), 6)
    check_world_size(Config(ulysses_sequence_parallel_size=2), 2)
    check_world_size(Config(), 2)


def test_token_budgets_are_per_device_so_a_split_micro_batch_holds_sp_times_as_many():
    """verl's rule (ppo_max_token_len_per_gpu x ulysses_sequence_parallel_size): each device of the
    group holds 1/sp of the micro-batch's tokens, so a sequence longer than one device's budget fits."""
    from config import schedule
    long = dict(use_dynamic_bsz=True, ppo_max_token_len_per_device=100, log_prob_max_token_len_per_device=300,
                max_prompt_length=50, max_response_length=100)
    with pytest.raises(UserError, match=r"^ppo_max_token_len_per_device=100 \(the actor's token budget\) must hold "
                                        r"one whole sequence \(max_prompt_length \+ max_response_length = 150\)"):
        validate_config(Config(**long))
    cfg = Config(**long, ulysses_sequence_parallel_size=2)
    validate_config(cfg)
    assert [schedule(cfg, role).max_tokens for role in ("actor", "critic", "log_prob")] == [200, 200, 600]
    with pytest.raises(UserError, match=r"^ppo_max_token_len_per_device=100 \(the actor's token budget\) x "
                                        r"ulysses_sequence_parallel_size=3 = 300 must hold"):
        validate_config(Config(**{**long, "max_response_length": 300}, ulysses_sequence_parallel_size=3))
    # the critic's own budget is named by its own key
    with pytest.raises(UserError, match=r"^critic_ppo_max_token_len_per_device=120 \(the critic's token budget\) "
                                        r"must hold one whole sequence"):
        validate_config(Config(**{**long, "ppo_max_token_len_per_device": 200},
                               critic_ppo_max_token_len_per_device=120))


def test_models_that_cannot_split_are_named():
    model = tiny(heads=4, kv=2)
    model.set_attn_implementation(packing.register())
    assert ulysses.unsupported(model, 2) is None
    assert "4 attention heads and 2 key-value heads" in ulysses.unsupported(model, 4)
    assert "attention heads" in ulysses.unsupported(tiny(heads=6, kv=6), 4)
    assert "'sdpa'" in ulysses.unsupported(tiny(), 2)          # padded SDPA: the rows are not packed
    assert "'eager'" in ulysses.unsupported(tiny(attn="eager"), 2)
    from transformers import GptOssConfig, GptOssForCausalLM
    sinks = GptOssForCausalLM(GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           num_local_experts=2, num_experts_per_tok=1, attn_implementation="eager"))
    assert "attention sinks" in ulysses.unsupported(sinks, 2)
    from transformers import MambaConfig, MambaForCausalLM   # no attention at all: named, not an AttributeError
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4))
    assert "no attention heads" in ulysses.unsupported(mamba, 2)


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
    an even length, and a row whose first half holds no response position: log-probs, entropy, top-k/top-p log-probs, gradients and a ZeRO-3 step's
    weights, a critic's values and a reward model's scores against the unsplit pass
    (tests/ulysses_worker.py)."""
    out = tmp_path / "figures.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(ROOT / "tests" / "ulysses_worker.py"),
           str(out)]
    run = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    f = json.loads(out.read_text())
    for key in ("logprob", "entropy", "truncated", "values", "reward_scores", "zero3_logprob", "zero3_entropy",
                "zero3_truncated", "zero3_loss", "lopsided_logprob", "lopsided_entropy", "lopsided_truncated",
                "lopsided_values", "zero3_lopsided_logprob", "zero3_lopsided_entropy"):
        assert f[key] < 1e-5, (key, f)
    assert f["grad_relative"] < 1e-5 and f["zero3_grad_relative"] < 1e-5, f
    assert f["lopsided_grad_relative"] < 1e-5, f   # a rank with no response position: no crash, no hang
    assert f["zero3_weights"] < 1e-5 < f["weights_moved"], f
    # the test can fail: each rank attending only within its own half of the row is far off
    assert f["without_all_to_all"] > 1e-2, f


# one PPO step of train_ppo.py (tests/ulysses_train_worker.py): GAE with a critic, KL in the reward and
# as a loss, an entropy bonus; 16 sequences in 2 mini-batches (2 optimizer steps) of 2 micro-batches
# each; the demo's GQA Qwen2 (4 heads, 2 key-value heads); responses of varying length (EOS), so rows
# of odd length are padded for the split
STEP = ["--adv_estimator=gae", "--use_kl_in_reward=true", "--use_kl_loss=true", "--entropy_coeff=0.01",
        "--train_batch_size=8", "--rollout_n=2", "--ppo_mini_batch_size=4", "--ppo_micro_batch_size_per_device=4",
        "--ppo_epochs=1", "--total_training_steps=1", "--max_response_length=6", "--val_files=",
        "--test_freq=-1", "--save_freq=-1", "--rollout_engine=hf", "--mlflow_log_model=false", "--remove_padding=true"]
# the step's figures that must not depend on how the sequences were split
SAME_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/explained_var",
                "kl/mean", "reward/score_mean", "rollout/response_len_mean", "rollout/logprob_diff")


# the long-sequence recipe: activations recomputed in the backward pass (the all-to-alls run again
# inside it) and micro-batches by a per-device token budget, which a group of 2 doubles: sp=2 with
# 40 tokens per device forms the micro-batches that sp=1 forms with 80
RECIPE = {1: ["--use_dynamic_bsz=true", "--ppo_max_token_len_per_device=80"],
          2: ["--gradient_checkpointing=true", "--use_dynamic_bsz=true", "--ppo_max_token_len_per_device=40"]}


def one_step(out: Path, processes: int, sp: int, *extra: str) -> dict:
    """tests/ulysses_train_worker.py on `processes` ranks -> rank -> what it saved."""
    out.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", MLFLOW_TRACKING_URI=sqlite_uri(out))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", str(processes),
           "--main_process_port", str(free_port()), str(ROOT / "tests" / "ulysses_train_worker.py"), str(out),
           *STEP, *extra, f"--ulysses_sequence_parallel_size={sp}", f"--output_dir={out / 'run'}"]
    run = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(processes)}


def split_against_unsplit(unsplit: dict, split: dict) -> dict:
    """The largest differences of the step's numbers between sp=1 (rank d = data-parallel rank d)
    and sp=2 (ranks 2d and 2d + 1: data-parallel rank d's group)."""
    figures = {}
    for d, one in unsplit.items():
        two, other = split[2 * d], split[2 * d + 1]
        # 2 layers x (old, ref, values, the critic's and the actor's update) at least: split through ALST
        assert one["alst_calls"] == 0 and two["alst_calls"] >= 2 * 5 and other["alst_calls"] == two["alst_calls"]
        # each rank of the group sampled half of its prompts, the rollouts of one process without SP
        assert one["generated"] == [2 * two["generated"][0]] and two["generated"] == other["generated"], \
            (one["generated"], two["generated"], other["generated"])
        for key, value in two["batch"].items():   # the group trained on one batch, on both ranks alike
            assert torch.equal(value, other["batch"][key]), key
        for key in ("input_ids", "attention_mask", "responses", "response_mask"):   # the same rollouts as sp=1
            assert torch.equal(one["batch"][key], two["batch"][key]), (d, key)
        mask = one["batch"]["response_mask"].bool()
        mine = {key: float((one["batch"][key] - two["batch"][key])[mask].abs().max())
                for key in ("old_logprob", "ref_logprob", "values", "advantages", "returns")}
        # relative to figures above 1 (the gradient norms)
        mine.update({key: abs(one["metrics"][key] - two["metrics"][key]) / max(1.0, abs(one["metrics"][key]))
                     for key in SAME_METRICS})
        for role in ("actor", "critic"):
            a, b = one["grads"][role], two["grads"][role]
            assert a.keys() == b.keys() and len(a) > 0
            scale = max(float(g.abs().max()) for g in a.values())
            mine[f"{role}_grad_relative"] = max(float((a[n] - b[n]).abs().max()) for n in a) / scale
            a, b = one["weights"][role], two["weights"][role]
            mine[f"{role}_weights"] = max(float((a[n] - b[n]).abs().max()) for n in a)
            mine[f"{role}_moved"] = max(float((a[n] - w).abs().max()) for n, w in one["before"][role].items())
        mine["alst_calls"] = two["alst_calls"]
        figures = {k: max(v, figures.get(k, v)) for k, v in mine.items()}
    return figures


def assert_split_equals_unsplit(name: str, figures: dict) -> None:
    print(name, figures)
    for key in ("old_logprob", "ref_logprob", "values", "advantages", "returns", "actor_grad_relative",
                "critic_grad_relative", *SAME_METRICS):
        assert figures[key] < 1e-5, (name, key, figures)
    # AdamW's first steps move each weight by about lr x g / (|g| + 1e-8): elements whose gradient
    # is near 1e-8 turn fp32 rounding into a sizeable part of lr (seen: 2.7e-6 with lr 5e-5 on 4
    # ranks), so the weights are held to a tenth of the step, the gradients above to fp32
    for role in ("actor", "critic"):
        assert figures[f"{role}_weights"] < 0.1 * figures[f"{role}_moved"], (name, figures)


@pytest.mark.slow
def test_a_training_step_with_two_ranks_split_equals_one_unsplit(tmp_path):
    """ulysses_sequence_parallel_size=2 on 2 processes (one data-parallel rank, one SP group) against
    1 process without SP, same seed, same batch: the forward passes, the advantages, the losses, the
    gradient norms (DeepSpeed averages over both ranks: each rank's share of the gradient must be
    scaled so that the average is the whole gradient) and both models' weights after the step; the
    runs with the long-sequence recipe, and with a LoRA actor (the adapters split with the sequences:
    their gradients are the ones summed over the group). The plain split is the next test's, with two
    data-parallel ranks."""
    lora = ["--lora_rank=4", "--lora_alpha=8", "--actor_lr=1e-3"]
    for name, extra in (("recipe", RECIPE), ("lora", {1: lora, 2: lora})):
        assert_split_equals_unsplit(name, split_against_unsplit(one_step(tmp_path / f"sp1_{name}", 1, 1, *extra[1]),
                                                                one_step(tmp_path / f"sp2_{name}", 2, 2, *extra[2])))


@pytest.mark.slow
def test_two_groups_split_equal_two_data_parallel_ranks_unsplit(tmp_path):
    """4 processes, sp=2: two data-parallel ranks of one SP group each, against 2 processes without
    SP (each data-parallel rank samples with seed + its index either way): each group's batch, the
    whole-batch advantages (gathered from one rank per group), the losses, norms and weights."""
    figures = split_against_unsplit(one_step(tmp_path / "sp1", 2, 1), one_step(tmp_path / "sp2", 4, 2))
    assert_split_equals_unsplit("dp=2", figures)


def launch_command(tmp_path, out: Path, *extra: str) -> tuple[list[str], dict]:
    """train_ppo.py itself on 2 ZeRO-3 processes, one sequence-parallel group of 2."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MLFLOW_TRACKING_URI=sqlite_uri(tmp_path))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(ROOT / "train_ppo.py"), "--ulysses_sequence_parallel_size=2",
           "--train_batch_size=8", "--rollout_n=2", "--ppo_mini_batch_size=4", "--ppo_micro_batch_size_per_device=4",
           "--save_freq=1", "--test_freq=2", "--total_training_steps=3", "--mlflow_log_model=false",
           f"--output_dir={out}", *extra]
    return cmd, env


@pytest.mark.slow
def test_a_split_run_killed_or_interrupted_resumes_with_the_uninterrupted_numbers(tmp_path):
    """sp=2 through train_ppo.py's own loop (validation, checkpoints, final model): 3 steps straight;
    the same command with rank 1 SIGKILLed after step 1's checkpoint, then rank 0 interrupted twice
    (Ctrl-C, then again) after step 2's, then run to its end: each time the whole launch ends within
    a minute, and the resumed run logs the straight run's numbers at every step, exactly (same
    machine, same process layout)."""
    import signal
    from test_distributed import interrupt_twice, run_until_checkpoint_then
    comparable = lambda out: [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
                              for line in (out / "metrics.jsonl").read_text().splitlines()]
    cmd, env = launch_command(tmp_path, tmp_path / "straight")
    straight = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-5000:]
    out = tmp_path / "resumed"
    cmd, env = launch_command(tmp_path, out)
    code, took, output = run_until_checkpoint_then(cmd, env, out, 1, lambda pids: os.kill(pids[1], signal.SIGKILL))
    assert code != 0 and took < 60, output[-3000:]
    code, took, output = run_until_checkpoint_then(cmd, env, out, 2, interrupt_twice)
    assert "resuming from" in output and took < 60, output[-3000:]
    resumed = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resuming from" in resumed.stdout
    want = comparable(tmp_path / "straight")
    assert [r["step"] for r in want] == [0, 1, 2, 3] and "val/accuracy" in want[-1]
    assert comparable(out) == want
    assert (tmp_path / "straight" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_vllm_samples_what_a_split_lora_actor_computes(tmp_path):
    """sp=2 with the vLLM engine and a LoRA actor: each step's sampler log-probs (vLLM, unsplit, the
    merged weights synced after step 1) equal the split actor's on the same tokens
    (rollout/logprob_diff), before and after a weight sync."""
    out = tmp_path / "out"
    cmd, env = launch_command(tmp_path, out, "--total_training_steps=2", "--test_freq=-1", "--val_before_train=false",
                              "--save_freq=-1", "--rollout_engine=vllm", "--lora_rank=4", "--lora_alpha=8",
                              "--actor_lr=1e-3", "--rollout_sync_bucket_mb=0.5", "--rollout_kv_cache_gb=0.25")
    proc = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/logprob_diff"] < 1e-5, r
        assert r["actor/grad_norm"] > 0


# a family per feature the split pass must keep (as test_conformance.FAST, less gpt_oss's sinks and
# mamba, refused for SP): sliding windows, soft-caps, logit and attention scales, GQA
MUST_SPLIT = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text", "cohere", "cohere2", "granite", "phi3",
              "starcoder2", "mixtral", "qwen3_moe")


@pytest.mark.slow
def test_registry_walk_split_over_two_ranks_equals_each_models_own_forward(tmp_path):
    """Every decoder family of tests/model_registry.py, loaded with sp=2 as a run loads it: the split
    pass's log-probs and entropies (at temperature 0.7) and their gradients equal the model's own
    forward on each sequence alone (tests/ulysses_registry_worker.py); every family that cannot split
    is refused at load with its reason in one line (ulysses.unsupported, UNSPLITTABLE), none fails."""
    out = tmp_path / "families.json"
    (tmp_path / "work").mkdir()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(ROOT / "tests" / "ulysses_registry_worker.py"), str(out),
           str(tmp_path / "work")]
    run = forkserver.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = json.loads(out.read_text())
    failed = {family: why for family, why in results.items() if why != "ok" and not why.startswith("refused: ")}
    assert not failed, "\n".join(f"{family}: {why}" for family, why in failed.items())
    assert set(MUST_SPLIT) <= {family for family, why in results.items() if why == "ok"}, results
    for family, why in results.items():
        if why != "ok":   # the split's reason, or (families attending to later tokens) load_models' own
            acausal = family in model_registry.ACAUSAL
            reason = "is not a causal language model" if acausal else "ulysses_sequence_parallel_size=2"
            assert "\n" not in why and reason in why, (family, why)


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


def test_dry_run_divides_activations_by_sp_and_names_the_sp_that_fits(capsys):
    """--dry_run's table: with ulysses_sequence_parallel_size each rank holds 1/sp of a sequence's
    activations and logits, nothing else changes; a run that does not fit for its activations
    is told the smallest sp that makes it fit (one that divides the world and the heads)."""
    from plumbing import preflight
    llama = preflight.ModelShape(params=6_738_415_616, trainable=6_738_415_616, largest=131_072_000, hidden=4096,
                                 layers=32, heads=32, kv_width=1024, intermediate=11008, vocab=32000, kv_heads=8)
    plan = preflight.Plan(
        actor=llama, critic=llama, ref=None, reward=None, worlds=[8], zero_stage=3, offload_optimizer=False,
        offload_params=False, ref_offload=False, reward_offload=False, bf16=True, micro_batch=1, critic_micro_batch=1,
        seq_len=65536, response_len=61440, gen_batch=1, gradient_checkpointing=True, critic_gradient_checkpointing=True,
        engine="vllm", gpu_memory_utilization=0.1, kv_cache_gb=1.0, gpu_bytes=80 * 2**30, host_bytes=2**41,
        local_ranks=8, baseline_bytes=0)
    rows = {1: preflight.rows_for(plan, 8), 2: preflight.rows_for(dataclasses.replace(plan, sp=2), 8)}
    for (what, one, _), (what_split, two, _) in zip(rows[1], rows[2]):
        if "activations" in what or "logits" in what:
            assert two == pytest.approx(one / 2) and "sequence-parallel" in what_split, (what, one, two)
        else:
            assert two == one and what == what_split, what
    need = {sp: preflight.need(r)[0] for sp, r in rows.items()}
    assert need[2] < need[1]
    plan.gpu_bytes = int((need[1] + need[2]) / 2)   # fits with sp=2, not without
    assert not preflight.report(plan)
    out = capsys.readouterr().out
    assert "ulysses_sequence_parallel_size=2 fits" in out, out
    assert preflight.report(dataclasses.replace(plan, sp=2))
    four = preflight.need(preflight.rows_for(dataclasses.replace(plan, sp=4), 8))[0]
    assert preflight.sp_that_fits(plan, 8, four) == 4                  # 2 is too little, 3 does not divide 8 ranks
    two_kv = dataclasses.replace(llama, kv_heads=2)                    # 2 key-value heads: sp 4 cannot split them
    assert preflight.sp_that_fits(dataclasses.replace(plan, actor=two_kv), 8, four) is None
