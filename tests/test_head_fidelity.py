"""head_logprobs reproduces models whose logits are post-processed after the LM head (scaled,
soft-capped), values and gradients, and sizes its chunks by rows on CUDA (issue 19)."""
import pytest
import torch

from forward import head_logprobs as hl


def autograd_reference(hidden, weight, tokens, temperature, scale, softcap):
    z = hidden @ weight.t() * scale                                               # [N, V]
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    log_p = torch.log_softmax(z / temperature, dim=-1)                            # [N, V]
    return log_p.gather(1, tokens[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("scale, softcap", [(0.5, None), (1.0, 2.0), (0.25, 3.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("cols", [16, 50])   # the vocabulary in tiles, or whole (GPUs' chunks)
def test_scaled_and_soft_capped_logits_give_autograds_values_and_gradients(scale, softcap, temperature, cols,
                                                                          monkeypatch):
    monkeypatch.setattr(hl, "TILE_ROWS", 3)               # several blocks of 3 rows
    monkeypatch.setattr(hl, "TILE_COLS", cols)
    g = torch.Generator().manual_seed(0)
    hidden = (3 * torch.randn(10, 16, generator=g)).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_()
    tokens = torch.randint(0, 50, (10,), generator=g)
    tokens[:3] = torch.tensor([49, 48, 32])   # the last tile's last and first columns, and a tile's first
    w_lp, w_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)
    results = []
    for fn in (lambda: hl.head_logprobs(hidden, weight, tokens, temperature, scale, softcap),
               lambda: autograd_reference(hidden, weight, tokens, temperature, scale, softcap)):
        hidden.grad = weight.grad = None
        logprob, entropy = fn()
        ((logprob * w_lp).sum() + (entropy * w_ent).sum()).backward()
        results.append((logprob.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()))
    for mine, ref in zip(*results):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cols", [16, 50])
@pytest.mark.parametrize("softcap", [2.0, None])      # None: the backward's log-prob-only path (_logprob_grads)
@pytest.mark.parametrize("weight_grad", [True, False])   # False: a frozen head (LoRA), only hidden's gradient
def test_without_the_entropy_the_log_probs_and_their_gradients_are_autograds(cols, softcap, weight_grad, monkeypatch):
    """with_entropy=False (the update when no loss term reads the entropy): no entropy, and the
    log-probs and the gradients of a loss on them are autograd's; a token repeated in the batch
    adds its rows' parts to the same row of the weight's gradient."""
    monkeypatch.setattr(hl, "TILE_ROWS", 3)
    monkeypatch.setattr(hl, "TILE_COLS", cols)
    g = torch.Generator().manual_seed(1)
    hidden = (3 * torch.randn(10, 16, generator=g)).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_(weight_grad)
    tokens = torch.randint(0, 50, (10,), generator=g)
    tokens[3:7] = torch.tensor([49, 49, 49, 0])   # the same token in rows of one block (3-5) and the next, the first one
    w_lp = torch.randn(10, generator=g)
    results = []
    for fn in (lambda: hl.head_logprobs(hidden, weight, tokens, 0.7, 0.5, softcap, with_entropy=False),
               lambda: autograd_reference(hidden, weight, tokens, 0.7, 0.5, softcap)):
        hidden.grad = weight.grad = None
        logprob, entropy = fn()
        (logprob * w_lp).sum().backward()
        results.append((logprob.detach(), hidden.grad.clone(), weight.grad, entropy))
    assert results[0][3] is None
    assert (results[0][2] is None) == (not weight_grad)
    for mine, ref in zip(results[0][:3], results[1][:3]):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_under_bf16_a_confident_tokens_gradient_keeps_its_one_minus_p(monkeypatch):
    """Under bf16 autocast the log-prob-only backward rounds p - onehot, not p: for a token the
    model is sure of (p near 1, where bf16's steps are 2^-8) rounding p first loses 1 - p, the
    whole gradient of that row. Against float64 autograd through the forward's own bf16 logits."""
    monkeypatch.setattr(hl, "TILE_ROWS", 3)
    monkeypatch.setattr(hl, "TILE_COLS", 16)
    g = torch.Generator().manual_seed(2)
    hidden = (3 * torch.randn(64, 16, generator=g)).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_()
    with torch.no_grad():
        p = (hidden @ weight.t()).softmax(-1)
    tokens, p_token = p.argmax(-1), p.amax(-1)
    sure = (p_token > 0.99) & (p_token < 0.9999)     # beyond 0.9999 the gradient is below bf16's resolution
    assert sure.sum() >= 5
    w_lp = torch.randn(64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprob, _ = hl.head_logprobs(hidden, weight, tokens, with_entropy=False)
    (logprob * w_lp).sum().backward()
    h64 = hidden.detach().bfloat16().double().requires_grad_()
    w64 = weight.detach().bfloat16().double().requires_grad_()
    z = h64 @ w64.t()
    z = z + (z.bfloat16().double() - z).detach()     # the bf16 logits the forward made, differentiated exactly
    (torch.log_softmax(z, -1).gather(1, tokens[:, None]).squeeze(1) * w_lp.double()).sum().backward()
    error = (hidden.grad.double() - h64.grad).norm(dim=-1) / h64.grad.norm(dim=-1)   # [64] per row
    assert error[sure].max() < 0.05, error[sure]      # p rounded first: 0.5-1.3
    assert (weight.grad.double() - w64.grad).norm() / w64.grad.norm() < 0.02


def test_chunks_go_by_rows_on_cuda_and_by_cache_on_cpu():
    assert hl.chunk_rows(151_936, "cuda") >= 1024          # Qwen2.5's vocabulary: 13 rows was the defect
    assert hl.chunk_rows(32_000, "cuda") >= 1024
    assert hl.chunk_rows(151_936, "cuda") * 151_936 <= 2 ** 30   # a chunk's fp32 logits stay within 4 GB
    assert hl.chunk_rows(151_936, "cpu") * 151_936 <= hl.CHUNK_ELEMENTS
    assert hl.blocks(151_936, "cuda") == (hl.chunk_rows(151_936, "cuda"), 151_936)   # whole rows on GPUs
    rows, cols = hl.blocks(151_936, "cpu")
    assert rows * cols * 4 <= 4 << 20                      # a CPU tile's fp32 logits stay in cache
