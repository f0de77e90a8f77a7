"""MLPs that keep only their projections' outputs for the backward (forward/lean_mlp.py): the same
numbers and gradients as the model's own forward, less kept for the backward, and a module whose
forward is not the one its children's names suggest keeps its own."""
import copy

import pytest
import torch

import model_registry
from forward import lean_mlp, packing
from forward.batch import pack_batch
from forward.readouts import critic_values, response_logprobs
from modeling.value_models import load_value_model

# gate and up projections (Qwen2), one projection holding both halves (Phi-3), a plain MLP (Nemotron's ReLU^2)
FAMILIES = ["qwen2", "phi3", "nemotron"]
PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 21, 9, 1)]
RESPONSES = [[9 + (11 * i) % 200 for i in range(n)] for n in (7, 2, 12, 1)]
TOL = dict(rtol=1e-5, atol=1e-5)


def saved_bytes(run) -> int:
    """The bytes autograd keeps for the backward while `run` builds its graph (parameters aside)."""
    seen = {}

    def pack(x):
        if not isinstance(x, torch.nn.Parameter):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = run()
    return sum(seen.values()), out


def passes(actor, critic):
    """The actor's log-probs and the critic's values on a packed micro-batch, the bytes kept for their
    backward, and every trained parameter's gradient."""
    batch = pack_batch(PROMPTS, RESPONSES, pad_id=0)
    for model in (actor, critic):
        model.zero_grad(set_to_none=True)
    kept, (logprob, values) = saved_bytes(lambda: (response_logprobs(actor, batch, 0.7, with_entropy=False)[0],
                                                   critic_values(critic, batch)))
    (logprob.sum() + values.sum()).backward()
    grads = {(i, name): p.grad.clone() for i, model in enumerate((actor, critic))
             for name, p in model.named_parameters() if p.grad is not None}
    return [logprob.detach(), values.detach()], grads, kept


def pair(model_type, tmp_path):
    path = model_registry.save_tiny(model_type, tmp_path)
    actor, (critic, _) = model_registry.build(model_type), load_value_model(str(path), torch.float32)
    for model in (actor, critic):
        model.eval().set_attn_implementation(packing.register())
    return actor, critic


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lean_mlps_give_the_models_own_numbers_and_gradients_and_keep_less(model_type, tmp_path):
    actor, critic = pair(model_type, tmp_path)
    own, own_grads, own_kept = passes(actor, critic)
    layers = actor.config.num_hidden_layers
    assert lean_mlp.decide(actor) == layers and lean_mlp.decide(critic) == layers
    lean, lean_grads, lean_kept = passes(actor, critic)
    for a, b in zip(lean, own):
        torch.testing.assert_close(a, b, **TOL)
    assert lean_grads.keys() == own_grads.keys()
    for key, grad in own_grads.items():
        torch.testing.assert_close(lean_grads[key], grad, **TOL, msg=lambda m: f"grad of {key}: {m}")
    # at least one [tokens, intermediate] tensor a layer no longer kept, in both models
    tokens = sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))
    one = tokens * actor.config.intermediate_size * 4
    assert own_kept - lean_kept >= 2 * layers * one * 0.9, (own_kept, lean_kept)


def test_a_module_computing_otherwise_keeps_its_own_forward():
    """Children named like a gated MLP's, but up's output goes through the activation: the probe
    finds the difference and the module runs its own forward."""
    class Swapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False)
            self.down_proj, self.act_fn = torch.nn.Linear(16, 8, bias=False), torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    model = torch.nn.Sequential(Swapped())
    assert lean_mlp.decide(model) == 0 and "forward" not in model[0].__dict__


def test_without_gradients_and_in_a_copy_the_modules_own_weights_run(tmp_path, monkeypatch):
    actor, _ = pair("qwen2", tmp_path)
    lean_mlp.decide(actor)
    twin = copy.deepcopy(actor)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    calls = []
    original = lean_mlp._RecomputedDown.apply
    monkeypatch.setattr(lean_mlp._RecomputedDown, "apply", lambda *a: calls.append(1) or original(*a))
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        quiet = twin(input_ids=ids).logits
    assert not calls                                                               # no graph: the module's own forward
    loud = twin(input_ids=ids).logits
    assert calls                                                                   # the copy is lean too
    torch.testing.assert_close(loud.detach(), quiet, **TOL)                        # with its own weights, not the original's
    assert not torch.allclose(quiet, actor(input_ids=ids).logits.detach(), atol=1e-3)


def test_a_down_projection_replaced_after_load_runs_as_a_module(tmp_path):
    """An adapter put on the down projection after decide (its own forward): the lean path steps aside,
    so the adapter's part is in the output."""
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    actor, _ = pair("qwen2", tmp_path)
    mlp = actor.model.layers[0].mlp
    assert lean_mlp.decide(actor) and "forward" in mlp.__dict__
    x = torch.randn(1, 4, actor.config.hidden_size)
    plain = mlp(x)
    doubled = Doubled(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    doubled.weight = mlp.down_proj.weight
    mlp.down_proj = doubled
    torch.testing.assert_close(mlp(x), 2 * plain, **TOL)


def test_layers_that_checkpointing_recomputes_run_their_own_mlp(tmp_path, monkeypatch):
    """Under gradient checkpointing the recomputed layers' MLPs run their own forward (the lean path
    would only add work there); the last layer, kept whole, stays lean; the gradients are the model's."""
    from modeling.loading import recompute_activations
    actor, critic = pair("qwen2", tmp_path)
    own, own_grads, _ = passes(actor, critic)
    lean_mlp.decide(actor)
    calls = []
    original = lean_mlp._RecomputedDown.apply
    monkeypatch.setattr(lean_mlp._RecomputedDown, "apply", lambda *a: calls.append(a[-1].shape) or original(*a))
    with recompute_activations(actor, True):
        lean, lean_grads, _ = passes(actor, critic)
    assert len(calls) == 1                                                         # the last layer's, once
    assert not any("_lean_mlp_paused" in m.__dict__ for m in actor.modules())      # restored after
    for a, b in zip(lean, own):
        torch.testing.assert_close(a, b, **TOL)
    for key, grad in own_grads.items():
        torch.testing.assert_close(lean_grads[key], grad, **TOL, msg=lambda m: f"grad of {key}: {m}")
