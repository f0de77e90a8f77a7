"""Libraries a PPO run never uses, kept out of the process (they cost resident memory, not time).

    lean_imports.skip_unused()     # before Transformers, Accelerate or DeepSpeed are imported

- scikit-learn (with SciPy's parts it pulls in, about 40 MB): Transformers' generate() imports it
  for the candidate-length heuristic of assisted generation. Transformers is told it is absent.
- scipy.optimize (about 26 MB with the parts of SciPy it loads): Transformers' modeling_utils imports
  its loss table, whose object-detection losses (DETR's Hungarian matching) import it when SciPy is
  installed. No causal LM, critic or reward model uses them; Transformers is told SciPy is absent, as
  for scikit-learn. (MLflow's dataset logging imports scipy.sparse, about 10 MB, for every run.)
- Triton (about 70 MB), on a machine without CUDA: Transformers' masking code imports
  torch._dynamo, which imports Triton when it is installed (vLLM's CUDA build requires it). Triton
  compiles GPU kernels only; without a GPU it is dead weight, so it is marked absent the way
  Python marks a failed import (None in sys.modules): `import triton` raises ImportError and
  importlib.util.find_spec("triton") returns None, which is what torch, Transformers and vLLM
  check before using it.
Each takes effect only if the library is not imported yet; a process that already has it keeps it.
"""
import sys


def skip_unused() -> None:
    import torch
    if "triton" not in sys.modules and not torch.cuda.is_available():
        sys.modules["triton"] = None
    import transformers.utils
    if "transformers.generation" not in sys.modules:
        transformers.utils.is_sklearn_available = lambda: False
    if "transformers.loss" not in sys.modules:
        transformers.utils.is_scipy_available = lambda: False
