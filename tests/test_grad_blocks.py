"""forward/grad_blocks.py: a [V, H] gradient block made once and used again at each optimizer step,
with the numbers torch's own backward gives, never handed out while anything else holds it."""
import torch

from forward import grad_blocks
from forward import head_logprobs as hl

V, H = 32768, 256   # 32 MiB in fp32: the smallest block glibc maps apart (grad_blocks.MIN_BYTES)


def _embedding(seed: int = 0) -> torch.nn.Embedding:
    torch.manual_seed(seed)
    return torch.nn.Embedding(V, H, padding_idx=0)


def _ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (4, 300), generator=g)   # many repeats of each row, and the padding row 0
    ids[0, :20] = 0
    return ids


def _backward(embedding, ids, lookup: bool) -> None:
    weights = torch.linspace(-1, 1, H)
    with hl.own_lookup(embedding) if lookup else torch.enable_grad():
        (embedding(ids) * weights).sin().sum().backward()


def test_the_lookups_gradient_is_torchs_own_and_its_block_comes_back_zeroed_at_the_next_step():
    ours, theirs = _embedding(), _embedding()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    blocks = []
    for step in range(3):
        ids = _ids(step)
        _backward(ours, ids, lookup=True)
        _backward(theirs, ids, lookup=False)
        # bit for bit: duplicates added in torch's order, the padding row left at zero
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=0, atol=0)
        assert not bool(ours.weight.grad[0].any())
        blocks.append(ours.weight.grad.data_ptr())
        opt_ours.step()
        opt_theirs.step()
        grad_blocks.zero_grad(opt_ours)
        opt_theirs.zero_grad(set_to_none=True)
        assert ours.weight.grad is None
    assert blocks[1] == blocks[0] and blocks[2] == blocks[0], "the kept block was not used again"
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
    grad_blocks.release()
    assert len(grad_blocks._kept) == 0


def test_accumulating_micro_batches_add_into_the_kept_block_as_torch_adds():
    ours, theirs = _embedding(1), _embedding(1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    _backward(ours, _ids(5), lookup=True)
    grad_blocks.zero_grad(opt)   # kept
    for seed in (6, 7):          # one mini-batch of two micro-batches: the first takes the kept block
        _backward(ours, _ids(seed), lookup=True)
        _backward(theirs, _ids(seed), lookup=False)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=0, atol=0)
    grad_blocks.release()


def test_a_block_still_held_elsewhere_is_not_zeroed_or_handed_out():
    embedding = _embedding(2)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    _backward(embedding, _ids(8), lookup=True)
    held = embedding.weight.grad            # e.g. a caller that kept the last step's gradient
    before = held.clone()
    grad_blocks.zero_grad(opt)
    _backward(embedding, _ids(9), lookup=True)
    assert embedding.weight.grad.data_ptr() != held.data_ptr()
    torch.testing.assert_close(held, before, rtol=0, atol=0)
    grad_blocks.release()


def test_the_heads_weight_block_is_kept_and_its_gradient_is_the_same_each_step():
    """head_logprobs' weight gradient (its own block): the same inputs give the same gradient at
    each step, so the block used again was zeroed, and it is the one kept."""
    torch.manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(V, H) * 0.02)
    hidden = torch.randn(40, H)
    tokens = torch.randint(0, V, (40,))
    opt = torch.optim.SGD([weight], lr=0.0)   # the weight stays: each step's gradient must be the same
    grads, ptrs = [], []
    for _ in range(3):
        logprob, _ = hl.head_logprobs(hidden, weight, tokens)
        logprob.sum().backward()
        grads.append(weight.grad.clone())
        ptrs.append(weight.grad.data_ptr())
        opt.step()
        grad_blocks.zero_grad(opt)
    grad_blocks.release()
    assert ptrs[1] == ptrs[0] and ptrs[2] == ptrs[0]
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=0, atol=0)


def test_small_gradients_are_not_kept():
    embedding = torch.nn.Embedding(1000, 16)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    with hl.own_lookup(embedding):
        embedding(torch.tensor([[1, 2, 3]])).sum().backward()
    grad_blocks.zero_grad(opt)
    assert len(grad_blocks._kept) == 0


def test_a_block_with_a_view_on_it_is_not_handed_out():
    embedding = _embedding(4)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    _backward(embedding, _ids(10), lookup=True)
    rows = embedding.weight.grad[1:50]      # a view: the block's storage is still in use
    before = rows.clone()
    grad_blocks.zero_grad(opt)
    _backward(embedding, _ids(11), lookup=True)
    torch.testing.assert_close(rows, before, rtol=0, atol=0)
    grad_blocks.release()
