"""The last decoder layer's MLP on the rows a pass reads (forward/last_layer.py): the readouts give
the numbers and gradients of the whole layer, packed and padded, while the MLP sees fewer rows; a
model whose MLP mixes positions is found out at load and keeps the whole layer."""
import pytest
import torch

import model_registry
from forward import last_layer, packing
from forward.batch import pack_batch
from forward.readouts import critic_values, response_logprobs, reward_model_scores
from modeling.value_models import load_value_model

# a plain decoder, attention and MLP side by side (Cohere), a mixture of experts, norms after the MLP (Gemma 2)
FAMILIES = ["qwen2", "cohere", "mixtral", "gemma2"]
PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 21, 9, 1)]
RESPONSES = [[9 + (11 * i) % 200 for i in range(n)] for n in (7, 2, 12, 1)]
TOL = dict(rtol=1e-5, atol=1e-5)


def rows_seen(model):
    """A list that gets the number of rows the last layer's MLP computes at each call, and the hook."""
    seen = []
    mlp = last_layer.last_layer(model).mlp
    return seen, mlp.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:2].numel()))


def reads(actor, critic):
    """What the passes read, with the gradients of every trained parameter."""
    batch = pack_batch(PROMPTS, RESPONSES, pad_id=0)
    for model in (actor, critic):
        model.zero_grad(set_to_none=True)
    logprob, entropy = response_logprobs(actor, batch, 0.7, with_entropy=True)
    values = critic_values(critic, batch)
    (logprob.sum() + entropy.sum() + values.sum()).backward()
    with torch.no_grad():
        scores = reward_model_scores(critic, batch)
    grads = [p.grad.clone() for model in (actor, critic) for p in model.parameters() if p.grad is not None]
    return [logprob.detach(), entropy.detach(), values.detach(), scores], grads


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_read_rows_give_the_whole_layers_numbers(model_type, packed, tmp_path):
    path = model_registry.save_tiny(model_type, tmp_path)
    actor = model_registry.build(model_type)
    critic, _ = load_value_model(str(path), torch.float32)
    critic.eval()
    for model in (actor, critic):
        if packed:
            model.set_attn_implementation(packing.register())
        assert last_layer.decide(model), f"{model_type}: the last layer's MLP was not found row-wise"
    seen, hook = rows_seen(actor)
    fast, fast_grads = reads(actor, critic)
    hook.remove()
    total = sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))
    width = max(map(len, PROMPTS)) + max(map(len, RESPONSES))
    read = sum(len(r) for r in RESPONSES)                                          # one row per response token
    assert seen and max(seen) <= (read if packed else len(PROMPTS) * max(map(len, RESPONSES)))
    assert max(seen) < (total if packed else len(PROMPTS) * width)
    for model in (actor, critic):
        setattr(model, last_layer.ATTRIBUTE, [])                                   # the whole layer
    whole, whole_grads = reads(actor, critic)
    for a, b in zip(fast, whole):
        torch.testing.assert_close(a, b, **TOL)
    assert len(fast_grads) == len(whole_grads)
    for a, b in zip(fast_grads, whole_grads):
        torch.testing.assert_close(a, b, **TOL)


class Mixing(torch.nn.Module):
    """An MLP followed by a running sum over positions: still causal, no longer row by row."""
    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        return self.inner(x).cumsum(dim=1)


def test_an_mlp_that_mixes_positions_keeps_the_whole_layer():
    model = model_registry.build("qwen2")
    layer = last_layer.last_layer(model)
    layer.mlp = Mixing(layer.mlp)
    assert last_layer.decide(model) == []
    batch = pack_batch(PROMPTS, RESPONSES, pad_id=0)
    seen, hook = rows_seen(model)
    with torch.no_grad():
        logprob, _ = response_logprobs(model, batch, 1.0)
    hook.remove()
    assert seen == [batch["input_ids"].numel()]                                    # every row
    ids = torch.tensor([PROMPTS[2] + RESPONSES[2]])
    with torch.no_grad():
        own = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, len(PROMPTS[2]) - 1:-1], -1)
    expected = own.gather(1, torch.tensor(RESPONSES[2])[:, None])[:, 0]
    torch.testing.assert_close(logprob[2, :len(RESPONSES[2])], expected, rtol=1e-4, atol=1e-4)
