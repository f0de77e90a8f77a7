"""One rank of tests/test_ulysses.py's registry walk, under `accelerate launch` (2 processes, one
sequence-parallel group of 2, gloo).

Every decoder family of tests/model_registry.py is loaded through load_models as a run with
ulysses_sequence_parallel_size=2 loads it (remove_padding on); the actor's log-probs and entropies
(each rank scoring the response positions of its half of the packed row, DeepSpeed's all-to-all
in every attention layer) and their gradients (summed over the group, divided by its size) are
compared with the model's own forward on each sequence alone (eager attention), as
tests/test_conformance.py does for one process. A family load_models refuses for SP is recorded
with its one-line reason. Rank 0 writes {family: "ok" | "refused: ..." | "FAIL: ..."} to the
JSON file named on the command line.
"""
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch                                       # noqa: E402

from forward import ulysses                        # noqa: E402

SP = 2


def whole_grad(p: torch.Tensor) -> torch.Tensor:
    """The group's parts of p's gradient put together (a collective: every parameter, both ranks)."""
    grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
    torch.distributed.all_reduce(grad)
    return grad / SP


def main(out_path: Path, work: Path) -> None:
    ulysses.setup(SP)                              # the group first: every split pass is a collective
    import model_registry
    from config import Config
    from errors import UserError
    from modeling.loading import REFUSED, load_models
    from test_conformance import TEMPERATURES, check, eager_twin
    rank = torch.distributed.get_rank()
    results = {}
    for model_type in model_registry.families():
        if model_type in REFUSED:                  # refused for every layout (test_conformance checks the line)
            continue
        path = work / model_type
        if rank == 0:
            model_registry.save_tiny(model_type, path)
        torch.distributed.barrier()
        try:
            # the actor alone (no KL, so no reference: a second ZeRO-3 load of the same weights)
            _, actor, _, _, _ = load_models(Config(model_path=str(path), adv_estimator="grpo", remove_padding=True,
                                                   use_kl_in_reward=False, ulysses_sequence_parallel_size=SP))
        except UserError as e:
            results[model_type] = f"refused: {e}"
            continue
        try:
            twin = eager_twin(actor)
            # one temperature, not test_conformance's two: the split (the all-to-all in every attention
            # layer, combine()) comes before the head divides by it, and test_conformance holds the
            # head to both temperatures on every family. 0.7: a temperature left out would show.
            # combine()'s backward inside is a collective of the group too
            check(actor, twin, min(TEMPERATURES), whole_grad)
            results[model_type] = "ok"
        except Exception as e:   # the same numbers on both ranks after combine(): both fail alike
            results[model_type] = f"FAIL: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            if rank == 0:
                traceback.print_exc()
        torch.distributed.barrier()
    if rank == 0:
        out_path.write_text(json.dumps(results, indent=1))
    print(f"rank {rank}: {sum(v == 'ok' for v in results.values())} of {len(results)} families ok", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
