#!/usr/bin/env bash
# Two "machines" on this one, over 127.0.0.1: the multi-node launch path (num_machines 2,
# machine_rank 0 and 1) exercised without a second host. On real machines run the same
# `accelerate launch` line on each, with its own --machine_rank and the main machine's address.
#   scripts/two_machines_loopback.sh [extra train_ppo.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/two_machines}
port=${PORT:-29555}
common=(--config_file accelerate_configs/zero3_2machines.yaml --num_machines 2 --num_processes 2
        --main_process_ip 127.0.0.1 --main_process_port "$port")
args=(--output_dir "$out" --train_batch_size=16 --rollout_n=2 --ppo_mini_batch_size=8
      --ppo_micro_batch_size_per_device=8 --total_training_steps=2 --test_freq=2 "$@")
mkdir -p "$(dirname "$out")"
accelerate launch "${common[@]}" --machine_rank 1 train_ppo.py "${args[@]}" > "$out.machine1.log" 2>&1 &
worker=$!
accelerate launch "${common[@]}" --machine_rank 0 train_ppo.py "${args[@]}"
wait "$worker"
echo "both machines finished; metrics in $out/metrics.jsonl, machine 1's log in $out.machine1.log"
