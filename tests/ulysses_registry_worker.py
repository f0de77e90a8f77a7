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


def gradients_match(actor, twin, lp, lp_ref) -> None:
    actor.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    sum(x.sum() for x in lp).backward()            # combine()'s backward: a collective of the group
    sum(x.sum() for x in lp_ref).backward()
    for (name, p), q in zip(actor.named_parameters(), twin.parameters()):
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        torch.distributed.all_reduce(grad)         # every parameter on both ranks, the same order
        if q.grad is None:
            assert not grad.any(), name
            continue
        torch.testing.assert_close(grad / SP, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")


def main(out_path: Path, work: Path) -> None:
    ulysses.setup(SP)                              # the group first: every split pass is a collective
    import model_registry
    from config import Config
    from errors import UserError
    from modeling.loading import REFUSED, load_models
    from test_conformance import TEMPERATURES, TOL, eager_twin, fast, reference
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
            _, actor, _, _, _ = load_models(Config(model_path=str(path), adv_estimator="grpo", remove_padding=True,
                                                   ulysses_sequence_parallel_size=SP))
        except UserError as e:
            results[model_type] = f"refused: {e}"
            continue
        try:
            twin = eager_twin(actor)
            for temperature in TEMPERATURES:
                lp_ref, ent_ref = reference(twin, temperature)
                lp, ent = fast(actor, temperature)
                for a, b in zip(lp, lp_ref):
                    torch.testing.assert_close(a.detach(), b.detach(), **TOL)
                for a, b in zip(ent, ent_ref):
                    torch.testing.assert_close(a, b, **TOL)
            gradients_match(actor, twin, lp, lp_ref)
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
