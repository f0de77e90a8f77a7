"""One rank of tests/test_ulysses.py's training-step check, under `accelerate launch` (ZeRO-3, gloo).

train_ppo.py's own setup() and train_step() run one PPO step (generate, score, the actor's, ref's
and critic's forward passes, advantages, the critic's and the actor's update) with the options on
the command line. The batch the update sees (old and ref log-probs, values, advantages, returns),
the step's reduced metrics, how many prompts the rank's engine sampled, each model's gradient at its first optimizer step (as DeepSpeed
reduced it over the ranks), the actor's and critic's full weights after the step and how many
attention layers ran through DeepSpeed's UlyssesSPAttentionHF go to
<out_dir>/rank<N>.pt, for the test to hold a run with ulysses_sequence_parallel_size=2 on 2
processes against one with 1 process and no sequence parallelism.

    python -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml --num_processes 2 \
        tests/ulysses_train_worker.py OUT_DIR --ulysses_sequence_parallel_size=2 ...

train_ppo.py is a script that nothing imports (tests/test_layout.py); runpy runs it under another
name than __main__, which gives its functions without its command line. This process never runs it
as __main__, so there is one copy of it, as in a real run.
"""
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def weights(run) -> dict:
    """role -> {name: full tensor} of the trained models; every rank runs the ZeRO-3 gathers."""
    import deepspeed
    out = {}
    for role, (model, _, _) in run.trained.items():
        params = list(model.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            out[role] = {n: p.detach().cpu().clone() for n, p in params}
    return out


def main(out_dir: Path, argv: list[str]) -> None:
    script = runpy.run_path(str(ROOT / "train_ppo.py"), run_name="train_ppo_step")
    env = script["train_step"].__globals__          # the namespace the script's functions read
    cfg = env["load_config"](argv)
    run = env["setup"](cfg)
    seen = {}
    real_update_critic = env["update_critic"]

    def update_critic(accelerator, critic, optim, batch, *args, **kwargs):   # the batch both updates see
        seen.update({k: v.detach().cpu().clone() for k, v in batch.items()})
        return real_update_critic(accelerator, critic, optim, batch, *args, **kwargs)

    env["update_critic"] = update_critic
    from forward import ulysses   # the same module the script's passes use
    real_alst, alst_calls = ulysses._ulysses, []

    def counting_alst(config):   # one call per attention layer of each split forward
        alst_calls.append(1)
        return real_alst(config)

    ulysses._ulysses = counting_alst
    real_optimizer_step, grads = env["optimizer_step"], {}

    def optimizer_step(model, optim, *args, **kwargs):   # the first step's gradient, reduced over the ranks
        role = next(r for r, (m, _, _) in run.trained.items() if m is model)
        if role not in grads:
            from deepspeed.utils import safe_get_full_grad   # a collective under ZeRO-3: every rank is here
            grads[role] = {n: g.detach().cpu().clone() for n, p in model.module.named_parameters()
                           if (g := safe_get_full_grad(p)) is not None}
        return real_optimizer_step(model, optim, *args, **kwargs)

    env["optimizer_step"] = optimizer_step
    real_generate, generated = run.engine.generate, []

    def generate(prompts, *args, **kwargs):   # how many prompts this rank's engine sampled
        generated.append(len(prompts))
        return real_generate(prompts, *args, **kwargs)

    run.engine.generate = generate
    before = weights(run)
    metrics = env["train_step"](run, 1)
    rank = run.accelerator.process_index
    torch.save({"batch": seen, "metrics": metrics, "weights": weights(run), "before": before,
                "alst_calls": len(alst_calls), "grads": grads, "generated": generated},
               out_dir / f"rank{rank}.pt")
    print(f"rank {rank}: step done, actor/pg_loss={metrics['actor/pg_loss']:.6g}", flush=True)
    run.tracker.finish("FINISHED", None, None)
    run.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
