"""MLPs that keep for their backward only what their projections made, not the element-wise work after.

A gated MLP, down(act(gate(x)) * up(x)), leaves autograd four [tokens, intermediate] tensors for its
backward: gate(x) (for act's), act(gate(x)) and up(x) (for the product's) and the product (the down
projection's input, for its weight gradient). Here it keeps gate(x) and up(x) alone, and the backward
makes act(gate(x)) * up(x) again from them: element-wise work, no matmul. A plain MLP, down(act(up(x))),
keeps up(x) alone instead of two. In the update the MLP's intermediates are most of what a layer holds
(W3's actor micro-batch: 15.6 of 29.8 MB a layer), so half of them go.

    decide(model)     # at load, trained models: the MLPs proven to run this way -> how many

Which modules qualify is decided on the model at load: a module whose children are exactly
gate_proj, up_proj, down_proj and act_fn (Llama, Qwen, Mistral, Gemma ...), gate_up_proj, down_proj
and activation_fn (Phi-3: the two halves of one projection, in either order) or up_proj, down_proj
and act_fn / act (ReLU^2, GELU MLPs), with plain nn.Linear projections. Each is kept where its output
and every gradient on a probe come out as its own forward's. The rest run as they are: MoE experts,
MLPs with a norm or dropout inside, Conv1D projections. At run time the lean path steps aside (the
module's own forward runs) without gradients, under autocast, in layers that gradient checkpointing
recomputes (`paused`), and where the down projection is no longer a plain nn.Linear (an adapter put
in later), its weight is partitioned (ZeRO-3) or it is hooked (DeepSpeed): there the projection must
run as a module call.
"""
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# (first, second, down, activations): first None = a plain MLP; second None = first's output holds both halves
SPECS = (("gate_proj", "up_proj", "down_proj", ("act_fn",)),
         ("gate_up_proj", None, "down_proj", ("activation_fn", "act_fn")),
         (None, "up_proj", "down_proj", ("act_fn", "act")))
ATTRIBUTE = "_lean_mlp"     # on a qualifying module: its candidate (names only, so that a deep copy reads its own)
PAUSED = "_lean_mlp_paused"


class _RecomputedDown(torch.autograd.Function):
    """down(act(gate) * other), or down(act(gate)) for a plain MLP, keeping the inputs (gate and other, or
    the one projection holding both halves) for the backward, not what act and the product made. kind:
    "plain" (inputs: up), "gated" (gate, up), "gate first" / "gate second" (the halves of one input)."""

    @staticmethod
    def forward(ctx, kind, act, weight, bias, *inputs):
        ctx.kind, ctx.act, ctx.has_bias = kind, act, bias is not None
        ctx.save_for_backward(weight, *inputs)
        gate, other = _split(kind, inputs)
        mid = act(gate)
        if other is not None:
            mid = mid * other if mid is gate else mid.mul_(other)
        return F.linear(mid, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight, *inputs = ctx.saved_tensors
        kind, needs = ctx.kind, ctx.needs_input_grad
        gate, other = _split(kind, inputs)
        wants_input = any(needs[4:])
        with torch.enable_grad():
            leaf = gate.detach().requires_grad_(wants_input)
            activated = ctx.act(leaf)
        act = activated.detach()
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if needs[2]:   # the down projection's input, made again for its weight gradient and let go
            mid = act if other is None else act * other
            grad_weight = rows.t().mm(mid.reshape(-1, mid.shape[-1]))
            del mid
        if ctx.has_bias and needs[3]:
            grad_bias = rows.sum(0)
        grad_inputs = [None] * len(inputs)
        if wants_input:
            grad_mid = grad.matmul(weight)
            grad_other = None if other is None else grad_mid * act
            grad_act = grad_mid if other is None else grad_mid.mul_(other)
            (grad_gate,) = torch.autograd.grad(activated, leaf, grad_act)
            if kind == "plain":
                grad_inputs = [grad_gate]
            elif kind == "gated":
                grad_inputs = [grad_gate if needs[4] else None, grad_other if needs[5] else None]
            else:
                grad_inputs = [torch.cat((grad_gate, grad_other) if kind == "gate first" else (grad_other, grad_gate), -1)]
        return (None, None, grad_weight, grad_bias, *grad_inputs)


def _split(kind: str, inputs) -> tuple:
    """(the activation's input, the other factor or None) from the Function's inputs."""
    if kind == "plain":
        return inputs[0], None
    if kind == "gated":
        return inputs
    first, second = inputs[0].chunk(2, dim=-1)
    return (first, second) if kind == "gate first" else (second, first)


def _candidates(module) -> list:
    """(kind, input projections' names, down's name, activation's name): the ways `module` may compute
    its output, from its children's names."""
    children = dict(module.named_children())
    found = []
    for first, second, down, activations in SPECS:
        for act in activations:
            names = {n for n in (first, second, down, act) if n}
            if set(children) != names or not all(_plain_linear(children[n]) for n in names - {act}) or \
                    any(True for _ in children[act].parameters()):
                continue
            if first and second:
                found.append(("gated", (first, second), down, act))
            elif first:
                found += [(kind, (first,), down, act) for kind in ("gate first", "gate second")]
            else:
                found.append(("plain", (second,), down, act))
    return found


def _plain_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _lean_forward(self, x, *args, **kwargs):
    down = getattr(self, getattr(self, ATTRIBUTE)[2])
    if args or kwargs or self.__dict__.get(PAUSED) or not torch.is_grad_enabled() or \
            torch.is_autocast_enabled(x.device.type) or \
            not _plain_linear(down) or hasattr(down.weight, "ds_id") or down._forward_hooks or down._forward_pre_hooks:
        return type(self).forward(self, x, *args, **kwargs)
    return _apply(self, getattr(self, ATTRIBUTE), x)


def _apply(module, candidate, x):
    kind, inputs, down, act = candidate
    down = getattr(module, down)
    return _RecomputedDown.apply(kind, getattr(module, act), down.weight, down.bias,
                                 *(getattr(module, name)(x) for name in inputs))


def _same(module, candidate, tolerance: float) -> bool:
    """The module's own forward and the lean one agree on a probe: the output and the gradients of the
    input and of every trained parameter."""
    down = getattr(module, candidate[2])
    width = getattr(module, candidate[1][0]).in_features
    probe = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(0)).to(down.weight)
    cotangent = torch.randn(1, 5, down.out_features, generator=torch.Generator().manual_seed(1)).to(down.weight)
    params = [p for p in module.parameters() if p.requires_grad]

    def run(forward):
        x = probe.clone().requires_grad_(True)
        with torch.enable_grad():
            out = forward(x)
            grads = torch.autograd.grad(out, [x] + params, cotangent, allow_unused=True)
        return [out.detach(), *grads]

    try:
        own = run(lambda x: type(module).forward(module, x))
        lean = run(lambda x: _apply(module, candidate, x))
    except Exception:
        return False
    for a, b in zip(own, lean):
        if (a is None) != (b is None):
            return False
        if a is not None and (a.shape != b.shape or not bool(a.isfinite().all()) or
                              float((a - b).abs().max()) > tolerance * max(1.0, float(a.abs().max()))):
            return False
    return True


@torch.no_grad()
def decide(model, tolerance: float = 1e-5) -> int:
    """Switch every MLP of `model` that the probe proves to the lean backward -> how many. Parameters
    partitioned at load (ZeRO-3 init) cannot run the probe: those models keep their own forward."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return 0
    count = 0
    for module in model.modules():
        for candidate in _candidates(module):
            if _same(module, candidate, tolerance):
                setattr(module, ATTRIBUTE, candidate)
                module.forward = types.MethodType(_lean_forward, module)
                count += 1
                break
    return count


@contextmanager
def paused(modules):
    """The lean MLPs inside `modules` run their own forward meanwhile: in layers that gradient
    checkpointing recomputes, whose intermediates live only from the recompute to the layer's
    backward anyway, the lean path would only make act(gate) * up once more."""
    lean = [m for module in modules for m in module.modules() if ATTRIBUTE in m.__dict__]
    for m in lean:
        m.__dict__[PAUSED] = True
    try:
        yield
    finally:
        for m in lean:
            m.__dict__.pop(PAUSED, None)
