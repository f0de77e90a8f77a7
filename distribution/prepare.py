"""The script's config turned into Accelerate/DeepSpeed wiring: each model's role and the engines
prepared (plugins.py does the DeepSpeed side with plain values).
"""
from __future__ import annotations


import torch

from config import Config, schedule
from distribution import plugins as distributed
from distribution.plugins import Role, param_share
from errors import UserError
from modeling.loading import make_optimizer


def make_accelerator(cfg: Config):
    """-> (accelerator, ds): each model's role (trained or frozen, micro-batch, clipping, offload)
    decides its DeepSpeed engine config under `accelerate launch` with DeepSpeed."""
    roles = {"actor": Role(True, schedule(cfg, "actor").micro_batch, cfg.max_grad_norm)}
    if cfg.adv_estimator == "gae":
        roles["critic"] = Role(True, schedule(cfg, "critic").micro_batch, cfg.critic_max_grad_norm)
    if cfg.use_kl_in_reward or cfg.use_kl_loss:
        roles["ref"] = Role(False, schedule(cfg, "actor").micro_batch, offload=cfg.ref_offload)
    if cfg.reward_model_path:
        roles["reward"] = Role(False, schedule(cfg, "actor").micro_batch, offload=cfg.reward_offload)
    owned = {"train_micro_batch_size_per_gpu": ("ppo_micro_batch_size_per_device", cfg.ppo_micro_batch_size_per_device),
             "gradient_clipping": ("max_grad_norm", cfg.max_grad_norm)}
    return distributed.make_accelerator(cfg.dtype == "bf16", roles, owned)


def check_world_size(cfg: Config, world: int) -> None:
    """Batch sizes split over the data-parallel ranks: world / ulysses_sequence_parallel_size (the
    ranks of one sequence-parallel group hold the same sequences)."""
    sp = cfg.ulysses_sequence_parallel_size
    if world % sp:
        raise UserError(f"ulysses_sequence_parallel_size={sp} does not divide the {world} processes (world = "
                        f"data-parallel x sequence-parallel): change it or num_processes")
    dp = world // sp
    ranks = f"the {dp} data-parallel ranks ({world} processes / ulysses_sequence_parallel_size={sp})" if sp > 1 \
        else f"the {world} processes"
    for key in ("train_batch_size", "ppo_mini_batch_size", "critic_ppo_mini_batch_size", "sft_batch_size"):
        if getattr(cfg, key) is not None and getattr(cfg, key) % dp:
            raise UserError(f"{key}={getattr(cfg, key)} is not divisible by {ranks}: change {key} or num_processes")
    tp = cfg.rollout_tensor_model_parallel_size
    if tp > 1 and sp > 1 and tp % sp and sp % tp:
        raise UserError(f"rollout_tensor_model_parallel_size={tp} and ulysses_sequence_parallel_size={sp}: one must "
                        "divide the other (a vLLM engine spans whole sequence-parallel groups or lies within one)")
    if tp > 1 and not torch.cuda.is_available():
        raise UserError(f"rollout_tensor_model_parallel_size={tp}: vLLM tensor parallelism needs GPUs and this machine "
                        "has none: set rollout_tensor_model_parallel_size=1 (one engine per process)")
    if tp > 1 and world % tp:
        raise UserError(f"rollout_tensor_model_parallel_size={tp} does not divide the {world} processes (one vLLM "
                        f"engine per group of {tp}): change it or num_processes")


def prepare_models(accelerator, ds: bool, cfg: Config, actor, critic, ref, reward_model, total_steps=None):
    """Trained models with their optimizers (and DeepSpeed engines under DeepSpeed); frozen ones as
    inference-only engines, or simply moved to the device."""
    def select(name, model=None):
        if ds:
            accelerator.state.select_deepspeed_plugin(name)
            if model is not None:
                distributed.size_buckets(accelerator.state.deepspeed_plugin, model)

    actor_optim, actor_sched = make_optimizer(actor, cfg.actor_lr, cfg, total_steps)
    select("actor", actor)
    actor, actor_optim = accelerator.prepare(actor, actor_optim)
    critic_optim = critic_sched = None
    if critic is not None:
        critic_optim, critic_sched = make_optimizer(critic, cfg.critic_lr, cfg, total_steps,
                                                    cfg.critic_lr_warmup_steps_ratio)
        select("critic", critic)
        critic, critic_optim = accelerator.prepare(critic, critic_optim)
    frozen = []
    for name, model in (("ref", ref), ("reward", reward_model)):
        if model is not None and ds:
            select(name, model)
            model = accelerator.prepare(model)
            model.eval()
        elif model is not None:
            model = model.to(accelerator.device)
        frozen.append(model)
    select("actor")
    local, total = param_share(actor)
    if accelerator.num_processes > 1:
        print(f"rank {accelerator.process_index}/{accelerator.num_processes}: actor holds {local} of {total} "
              f"parameters ({100 * local / total:.1f}%)", flush=True)
    return actor, actor_optim, actor_sched, critic, critic_optim, critic_sched, frozen[0], frozen[1]
