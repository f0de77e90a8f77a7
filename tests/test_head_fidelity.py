"""head_logprobs reproduces models whose logits are post-processed after the LM head (scaled,
soft-capped), values and gradients, and sizes its chunks by rows on CUDA (issue 19)."""
import copy
from contextlib import nullcontext

import pytest
import torch
from accelerate import Accelerator

import model_registry
import train_ppo
from config import Config
from core_algos import LOSS_AGG_MODES
from forward import head_logprobs as hl
from forward import readouts
from forward.batch import pack_batch
from plumbing.oom import OomReaction, base_sizes


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


def counting_short_way(monkeypatch, name: str) -> list:
    """Patches head_logprobs' `name` (_unshifted_forward), which gives None where a row block must run
    the shifted way, to count the blocks it made: -> [count]."""
    made, original = [0], getattr(hl, name)

    def counted(*args):
        result = original(*args)
        made[0] += result is not None
        return result
    monkeypatch.setattr(hl, name, counted)
    return made


@pytest.mark.parametrize("offset", [0.0, 150.0, -150.0, -97.0])   # in range; exp() overflows; every term underflows; to denormals
@pytest.mark.parametrize("fused", [False, True])             # the backward's recompute, or grad_of's forward
def test_without_the_entropy_logits_of_any_magnitude_give_autograds_log_probs_and_gradients(offset, fused,
                                                                                          monkeypatch):
    """For the gradients of the log-prob alone (grad_of) a CPU block is summed as exp(z) with no
    maximum subtracted, which holds only while exp() stays in range: logits all shifted by +150 (exp overflows), -150 (every term
    underflows) or -97 (the terms among the denormals, the sum imprecise) still give autograd's
    log-probs and gradients (log_softmax does not see a shift)."""
    monkeypatch.setattr(hl, "TILE_ROWS", 3)
    monkeypatch.setattr(hl, "TILE_COLS", 16)
    short = counting_short_way(monkeypatch, "_unshifted_forward")
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, 16, generator=g)
    hidden[:, 0] = 1.0                                   # with weight[:, 0] = offset: every logit + offset
    hidden.requires_grad_()
    weight = torch.randn(50, 16, generator=g)
    weight[:, 0] = offset
    weight.requires_grad_()
    tokens = torch.randint(0, 50, (7,), generator=g)
    w_lp = torch.randn(7, generator=g)
    grad_of = (lambda start, stop, logprob, entropy: (w_lp[start:stop], None)) if fused else None
    results = []
    for fn in (lambda: hl.head_logprobs(hidden, weight, tokens, with_entropy=False, grad_of=grad_of),
               lambda: autograd_reference(hidden, weight, tokens, 1.0, 1.0, None)):
        hidden.grad = weight.grad = None
        logprob, _ = fn()
        (logprob * w_lp).sum().backward()
        results.append((logprob.detach(), hidden.grad.clone(), weight.grad.clone()))
    assert short[0] == (3 if offset == 0.0 and fused else 0)   # 3 row blocks the short way, or none
    # hidden's gradient along the offset's column is offset x (1 - sum p): Σp's rounding times the offset
    for mine, ref in zip(*results):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4 + 2e-5 * abs(offset))


@pytest.mark.parametrize("cols", [16, 1000])
def test_passes_without_gradients_give_the_same_log_probs_with_and_without_the_entropy(cols, monkeypatch):
    """The reference's pass (no entropy) and the actor's old log-probs (with it) on the same weights
    are the same bits, so the KL at the first step is exactly 0, as in verl."""
    monkeypatch.setattr(hl, "TILE_ROWS", 3)
    monkeypatch.setattr(hl, "TILE_COLS", cols)
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(64, 32, generator=g), torch.randn(1000, 32, generator=g)   # logits of several units
    tokens = torch.randint(0, 1000, (64,), generator=g)
    with torch.no_grad():
        with_entropy, _ = hl.head_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)
        without, _ = hl.head_logprobs(hidden, weight, tokens, 0.7, with_entropy=False)
    assert torch.equal(with_entropy, without)


@pytest.mark.parametrize("offset", [0.0, 150.0, -150.0, -97.0])   # in range; exp() overflows; every term underflows; to denormals
def test_passes_without_gradients_give_float64s_log_probs_and_entropy_at_any_magnitude(offset, monkeypatch):
    """Passes without gradients (the old and the reference log-probs) sum a CPU tile as exp(z), with no
    maximum subtracted, and read the entropy off log-sum-exp - sum p z (verl's formula). Logits
    shifted by +150, -150 or -97 (exp() out of range, log-sum-exp outside LSE_RANGE) run the shifted
    way instead. Log-probs and entropy agree with float64 either way, the entropy to fp32's rounding
    of the logits' size also where it is far below that (one logit 40 above the rest), and the short
    way is taken exactly where it should be."""
    monkeypatch.setattr(hl, "TILE_ROWS", 4)
    monkeypatch.setattr(hl, "TILE_COLS", 16)
    short = counting_short_way(monkeypatch, "_unshifted_forward")
    g = torch.Generator().manual_seed(5)
    hidden = 0.3 * torch.randn(8, 16, generator=g)                  # logits of a unit or so: entropies of a few nats
    hidden[:, 0] = 1.0                                   # with weight[:, 0] = offset: every logit + offset
    weight = torch.randn(50, 16, generator=g)
    weight[:, 0] = offset
    hidden[4:, 1], weight[:, 1] = 40.0, 0.0              # rows 4-7 (the second row block): token 7's logit 40 higher
    weight[7, 1] = 1.0
    tokens = torch.randint(0, 50, (8,), generator=g)
    with torch.no_grad():
        logprob, entropy = hl.head_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)
        without, _ = hl.head_logprobs(hidden, weight, tokens, 0.7, with_entropy=False)
    ref_lp, ref_ent = autograd_reference(hidden.double(), weight.double(), tokens, 0.7, 1.0, None)
    assert short[0] == (4 if offset == 0.0 else 0)   # 2 row blocks in each of the two passes, or none
    assert torch.equal(logprob, without)                 # the same bits with and without the entropy
    assert (ref_ent[4:] < 1e-12).all() and (ref_ent[:4] > 0.1).all()
    largest = (hidden.double() @ weight.double().t() / 0.7).abs().amax(-1)   # [8] each row's largest logit
    torch.testing.assert_close(logprob.double(), ref_lp, rtol=1e-5, atol=1e-5 + 1e-6 * abs(offset))
    assert ((entropy.double() - ref_ent).abs() <= 1e-4 * ref_ent + 1e-6 * largest).all(), (entropy, ref_ent)


def test_a_tiny_loss_gradient_under_large_logits_keeps_its_digits(monkeypatch):
    """Logits near 60 (log-sum-exp in range for the sums without a maximum) and a loss gradient of
    1e-20 a row: the gradients made in the forward are still autograd's, to fp32's relative precision,
    not lost below fp32's normal floats (exp(-lse) is not folded into the rows' side there)."""
    monkeypatch.setattr(hl, "TILE_ROWS", 3)
    monkeypatch.setattr(hl, "TILE_COLS", 16)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 16, generator=g)
    hidden[:, 0] = 1.0
    hidden.requires_grad_()
    weight = torch.randn(50, 16, generator=g)
    weight[:, 0] = 60.0
    weight.requires_grad_()
    tokens = torch.randint(0, 50, (7,), generator=g)
    w_lp = torch.randn(7, generator=g) * 1e-20
    results = []
    for fn in (lambda: hl.head_logprobs(hidden, weight, tokens, with_entropy=False,
                                        grad_of=lambda start, stop, logprob, entropy: (w_lp[start:stop], None)),
               lambda: autograd_reference(hidden, weight, tokens, 1.0, 1.0, None)):
        hidden.grad = weight.grad = None
        logprob, _ = fn()
        (logprob * w_lp).sum().backward()
        results.append((hidden.grad[:, 1:].clone(), weight.grad[:, 1:].clone()))   # column 0: the offset's (see above)
    for mine, ref in zip(*results):
        torch.testing.assert_close(mine, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


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
    for vocab in (1_000, 32_768, 151_936):                 # grad_of keeps a row block's logits: within the budget
        assert 0 < hl.kept_rows(vocab, "cpu") <= hl.TILE_ROWS
        assert hl.kept_rows(vocab, "cpu") * vocab <= max(hl.KEPT_ELEMENTS, vocab)
    assert hl.kept_rows(151_936, "cpu") < hl.kept_rows(32_768, "cpu")
    assert hl.kept_rows(151_936, "cuda") == hl.chunk_rows(151_936, "cuda")   # a GPU chunk's logits exist at once anyway


def counting_recomputes(monkeypatch) -> list:
    """Patches head_logprobs' row-block gradients to record, per call, whether it made its logits
    again (the backward's recompute) rather than take those its forward kept (grad_of)."""
    calls, original = [], hl._row_block_grads

    def counted(*args, **kwargs):
        calls.append(kwargs.get("kept") is None)
        return original(*args, **kwargs)
    monkeypatch.setattr(hl, "_row_block_grads", counted)
    return calls


@pytest.mark.parametrize("cols, bf16", [(16, False), (50, False), (16, True)])
@pytest.mark.parametrize("softcap, entropy_grad", [(None, False), (None, True), (2.0, False), (2.0, True)])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_gradients_made_in_the_forward_are_the_backwards(cols, bf16, softcap, entropy_grad, weight_grad,
                                                         monkeypatch):
    """grad_of (a loss that is a sum of per-row terms, PPO's update): the gradients made in the
    forward from each row block's kept logits are the ones the backward would make, with no logits
    made again (also under bf16 autocast); a loss other than the one grad_of described falls back
    to the recompute, with a warning, and still gets its own gradients."""
    monkeypatch.setattr(hl, "TILE_ROWS", 3)
    monkeypatch.setattr(hl, "TILE_COLS", cols)
    calls = counting_recomputes(monkeypatch)
    g = torch.Generator().manual_seed(3)
    hidden = (3 * torch.randn(10, 16, generator=g)).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_(weight_grad)
    tokens = torch.randint(0, 50, (10,), generator=g)
    tokens[3:7] = torch.tensor([49, 49, 49, 0])
    old, w_ent = -3 * torch.rand(10, generator=g), torch.randn(10, generator=g)

    def per_row(lp, ent, old=old):   # nonlinear in the log-prob, clipped in places (zero gradient there)
        loss = torch.clamp((lp - old).exp(), 0.8, 1.2).sum() + (lp - old).square().sum()
        return loss + (ent * w_ent).sum() if entropy_grad else loss

    def grad_of(start, stop, lp, ent):
        lp = lp.clone().requires_grad_()
        ent = ent.clone().requires_grad_() if entropy_grad else None
        with torch.enable_grad():
            rows = slice(start, stop)
            loss = torch.clamp((lp - old[rows]).exp(), 0.8, 1.2).sum() + (lp - old[rows]).square().sum()
            if entropy_grad:
                loss = loss + (ent * w_ent[rows]).sum()
            grads = torch.autograd.grad(loss, [lp, ent] if entropy_grad else [lp])
        return grads[0], grads[1] if entropy_grad else None

    def run(given, loss_old=old):
        hidden.grad = weight.grad = None
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logprob, entropy = hl.head_logprobs(hidden, weight, tokens, 0.7, 0.5, softcap, with_entropy=entropy_grad,
                                                grad_of=given)
        made_in_forward = len(calls)
        per_row(logprob, entropy, loss_old).backward()
        return (logprob.detach(), hidden.grad.clone(), None if weight.grad is None else weight.grad.clone(),
                made_in_forward, sum(calls[made_in_forward:]))

    fused, plain = run(grad_of), run(None)
    with pytest.warns(UserWarning, match="gradients were made again"):
        other = run(grad_of, loss_old=old + 0.3)
    assert fused[3] == 4 and fused[4] == 0             # 4 row blocks, all in the forward, none made again
    assert plain[3] == 0 and plain[4] == 4
    assert other[3] == 4 and other[4] == 4             # the loss that came was not grad_of's: recomputed
    # without entropy and soft-cap the forward keeps exp(z - m) and makes p = exp(z - m) exp(m - lse),
    # where the recompute takes exp(z - lse): a rounding or two apart in each p; otherwise the same ops
    tol = dict(rtol=1e-5, atol=1e-6) if softcap is None and not entropy_grad else dict(rtol=1e-6, atol=1e-7)
    for mine, ref in zip(fused[:3], plain[:3]):
        torch.testing.assert_close(mine, ref, **tol)
    reference = run(None, loss_old=old + 0.3)
    for mine, ref in zip(other[:3], reference[:3]):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
    assert (fused[2] is None) == (not weight_grad)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("use_kl_loss, entropy_coeff, extras", [(False, 0.0, False), (True, 0.01, False),
                                                                 (True, 0.01, True)])
def test_the_update_makes_its_loss_gradients_in_the_heads_forward(loss_agg_mode, use_kl_loss, entropy_coeff, extras,
                                                                 monkeypatch):
    """update_actor hands its loss to the head (response_logprobs' loss_of): for every aggregation,
    with the KL loss and the entropy bonus or without, with rollout-correction weights and a
    sampling temperature (extras), no row block makes its logits again in the backward, and the
    gradients are those of the update without it."""
    monkeypatch.setattr(hl, "TILE_ROWS", 8)            # several row blocks a micro-batch
    calls = counting_recomputes(monkeypatch)
    prompts = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 21, 9, 4)]
    responses = [[9 + (11 * i) % 200 for i in range(n)] for n in (17, 2, 12, 30)]
    batch = pack_batch(prompts, responses, pad_id=0)
    g = torch.Generator().manual_seed(4)
    mask = batch["response_mask"]
    batch["old_logprob"] = -6 + 0.3 * torch.randn(mask.shape, generator=g)      # ratios far from 1: clipped in places
    batch["ref_logprob"] = -6 + 0.3 * torch.randn(mask.shape, generator=g)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    if extras:
        batch["is_weights"] = torch.rand(mask.shape, generator=g) * 2 * mask
    cfg = Config(train_batch_size=4, rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=2,
                 ppo_epochs=1, max_response_length=30, loss_agg_mode=loss_agg_mode, use_kl_loss=use_kl_loss,
                 kl_loss_type="low_var_kl", max_grad_norm=1e9)
    model = model_registry.build("qwen2")

    def update():
        actor = copy.deepcopy(model).train()
        grads = {}
        optim = torch.optim.SGD(actor.parameters(), lr=0.0)
        step = optim.step
        optim.step = lambda *a, **k: grads.update({n: p.grad.clone() for n, p in actor.named_parameters()}) or step()
        calls.clear()
        accelerator = Accelerator(cpu=True)
        stats = train_ppo.update_actor(accelerator, actor, optim, batch, cfg, nullcontext, False,
                                       temperature=0.7 if extras else 1.0, entropy_coeff=entropy_coeff,
                                       max_grad_norm=cfg.max_grad_norm,
                                       oom=OomReaction(accelerator, base_sizes(cfg), cfg.max_oom_retries))
        return grads, stats, list(calls)

    fused, fused_stats, fused_calls = update()
    monkeypatch.setattr(readouts, "_grads_by_rows", lambda *args: None)      # the head as before: no loss_of
    plain, plain_stats, plain_calls = update()
    assert len(fused_calls) == len(plain_calls) >= 4 and not any(fused_calls) and all(plain_calls)
    assert fused_stats["actor/pg_clipfrac"] > 0
    for key in plain_stats:
        assert fused_stats[key] == pytest.approx(plain_stats[key], rel=1e-6, abs=1e-9), key
    for name, grad in plain.items():   # without the entropy p is made two ways (see above): roundings apart
        atol = 1e-6 * grad.abs().max().item() if not entropy_coeff else 1e-8
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def _weight_blocks(run, vocab: int, hidden: int) -> int:
    """How many [vocab, hidden] tensors `run` makes (zeros, an embedding's dense gradient, a sum)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    made = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._schema.name.split("::")[-1] in ("zeros", "new_zeros", "embedding_dense_backward", "add") and \
                    torch.is_tensor(out) and tuple(out.shape) == (vocab, hidden):
                made.append(func)
            return out
    with Count():
        run()
    return len(made)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_tied_embedding_adds_its_rows_into_the_heads_gradient(packed, monkeypatch):
    """Tied input embedding and LM head in the update's pass: the same gradients as autograd's own two
    (the lookup's dense one added to the head's), from one [V, H] block instead of three."""
    from forward import packing
    model = model_registry.build("qwen2", tie_word_embeddings=True).requires_grad_(True)
    model.set_attn_implementation(packing.register())
    monkeypatch.setattr(packing, "worth_it", lambda batch, *_: packed)
    batch = pack_batch([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]], [[20, 21], [22], [23, 24, 25, 26]], pad_id=0)
    V, H = model.get_input_embeddings().weight.shape
    grads = {}
    for tied in (True, False):
        if not tied:
            monkeypatch.setattr(readouts, "tied_lookup", lambda embedding, weight: nullcontext())
        model.zero_grad(set_to_none=True)

        def step():
            logprob, _ = readouts.response_logprobs(model, batch, 0.8, loss_of=lambda lp, ent: lp.sum())
            logprob.sum().backward()
        blocks = _weight_blocks(step, V, H)
        grads[tied] = ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, blocks)
    (mine, mine_blocks), (plain, plain_blocks) = grads[True], grads[False]
    assert mine.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(mine[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")
    assert mine_blocks == 1 and plain_blocks >= 2, (mine_blocks, plain_blocks)


def test_a_tied_lookup_whose_head_gives_no_slot_keeps_its_own_gradient():
    """The model's own forward (its nn.Linear head, not head_logprobs) under tied_lookup: the lookup
    finds no gradient in the slot and gives autograd its own dense one, so the sum is autograd's."""
    model = model_registry.build("qwen2", tie_word_embeddings=True).requires_grad_(True)
    ids = torch.tensor([[5, 6, 7, 8, 5, 9]])
    weight = model.get_input_embeddings().weight
    grads = []
    for tied in (True, False):
        model.zero_grad(set_to_none=True)
        with hl.tied_lookup(model.get_input_embeddings(), weight) if tied else nullcontext() as slot:
            model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        assert (slot is not None) == tied and not (slot or {}).get("grad")
        grads.append(weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
