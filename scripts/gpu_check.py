"""GPU check (one GPU, under 5 minutes): vLLM sleep/wake and weight sync, and PPO throughput on a
random-initialised 0.5B-parameter Qwen2 (Qwen2.5-0.5B's shape) in bf16.

    python scripts/gpu_check.py [--steps 4] [--out runs/gpu_check] [--engine vllm|hf] [--zero3]

Prints: GPU memory held by the vLLM engine awake, asleep (level 1) and woken again; the time of a
full weight sync; then runs train_ppo.py with that rollout engine and prints tokens/s per GPU and
the share of the step spent generating, syncing and training (medians over steps 2..N).
--engine hf skips the engine check (a machine without vLLM's CUDA build); --zero3 launches the run
through `accelerate launch` with accelerate_configs/zero3.yaml on one process (DeepSpeed ZeRO-3 and
NCCL on the GPU). Needs CUDA; offline (the model is built locally with the demo's character
tokenizer). --tiny: the W1 shape and 2 steps, which runs on a CPU too (a check of this script).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=4096)


def gib(nbytes):
    return nbytes / 2**30


def build(out: Path, tiny: bool = False):
    import random
    import pandas as pd
    from make_demo import build_char_tokenizer, build_tiny_qwen2
    model = build_tiny_qwen2() if tiny else build_tiny_qwen2(vocab_size=151936, **QWEN25_05B).to(torch.bfloat16)
    model.save_pretrained(out / "model")
    build_char_tokenizer().save_pretrained(out / "model")
    rng = random.Random(0)
    prompts = [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(4096)]
    pd.DataFrame({"prompt": prompts}).to_parquet(out / "prompts.parquet")
    return sum(p.numel() for p in model.parameters())


def engine_memory(out: Path):
    from rollout.vllm import VLLMEngine
    free0, total = torch.cuda.mem_get_info()
    engine = VLLMEngine(str(out / "model"), dtype="bf16", seed=0, max_model_len=512, gpu_memory_utilization=0.3,
                        enable_sleep_mode=True)
    used = lambda: gib(free0 - torch.cuda.mem_get_info()[0])   # noqa: E731
    awake = used()
    engine.sleep()
    asleep = used()
    engine.wake_up(["weights"])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.bfloat16).cuda()
    start = time.perf_counter()
    engine.load_weights((n, p.data) for n, p in hf.named_parameters())
    torch.cuda.synchronize()
    sync_s = time.perf_counter() - start
    del hf
    torch.cuda.empty_cache()
    weights_only = used()
    engine.wake_up(["kv_cache"])
    woken = used()
    engine.shutdown()
    print(f"vLLM engine GPU memory: awake {awake:.2f} GiB, asleep {asleep:.2f} GiB, weights woken {weights_only:.2f} GiB, "
          f"fully woken {woken:.2f} GiB; full weight sync {sync_s:.3f} s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--zero3", action="store_true", help="launch through accelerate with the ZeRO-3 config")
    parser.add_argument("--tiny", action="store_true", help="the W1 shape, 2 steps: checks this script on a CPU")
    parser.add_argument("--engine_only", action="store_true", help="(internal) the engine memory check alone")
    args = parser.parse_args()
    if not (torch.cuda.is_available() or args.tiny):
        sys.exit("gpu_check needs CUDA")
    out = Path(args.out)
    if args.engine_only:
        return engine_memory(out)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; model {build(out, args.tiny) / 1e9:.3f}B parameters", flush=True)
    if args.engine == "vllm":
        # its own process: the engine's memory is measured with nothing else on the GPU, and freed after
        subprocess.run([sys.executable, __file__, "--out", str(out), "--engine_only"], check=True, cwd=ROOT)
    launch = [sys.executable]
    if args.zero3:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "accelerate_configs" / "zero3.yaml"), "--num_processes", "1"]
    shape = (["--train_batch_size=8", "--rollout_n=2", "--ppo_mini_batch_size=8", "--ppo_micro_batch_size_per_device=8",
              "--max_response_length=16", "--dtype=fp32"] if args.tiny else
             ["--train_batch_size=128", "--rollout_n=4", "--ppo_mini_batch_size=64",
              "--ppo_micro_batch_size_per_device=64", "--max_response_length=256", "--dtype=bf16"])
    run = launch + [str(ROOT / "train_ppo.py"), f"--model_path={out / 'model'}",
           f"--train_files={out / 'prompts.parquet'}", "--val_files=", f"--output_dir={out / 'run'}",
           f"--total_training_steps={2 if args.tiny else args.steps}", "--ppo_epochs=1",
           "--max_prompt_length=16", "--rollout_ignore_eos=true", f"--rollout_engine={args.engine}",
           "--rollout_gpu_memory_utilization=0.3", "--use_kl_in_reward=true", "--actor_lr=1e-6", "--critic_lr=1e-5",
           "--resume=never", "--reward_fn=rewards.arithmetic:compute_score"] + shape
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    subprocess.run(run, check=True, cwd=ROOT, env=env)
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    med = lambda key: statistics.median(r[key] for r in records)   # noqa: E731
    step = med("time/step_s")
    print(f"tokens/s per GPU {med('perf/tokens_per_s'):.0f}; step {step:.2f} s: generate {med('time/gen_s') / step:.0%}, "
          f"sync {med('time/sync_s') / step:.0%}, train {med('time/update_s') / step:.0%}, "
          f"forward {med('time/forward_s') / step:.0%}; peak memory printed above per rank")


if __name__ == "__main__":
    main()
