"""The last decoder layer's MLP and attention output projection on the rows a pass reads only.

A pass reads the model's output at some positions only: the actor's and the ref's where a position
predicts a response token, the critic's at the states before them, the reward model's at each
sequence's last token. Inside the last decoder layer the other positions reach those only through
the attention's keys and values; the attention's output projection and the MLP after it work row by
row, so their output at a row reaches that row alone. There they run on the rows read, and their
output elsewhere is 0 (the rows nobody reads keep finite numbers: the residual's). On W3, whose
prompts are two thirds of a sequence, that is two thirds of the last layer's MLP and output
projection, forward and backward; for the reward model nearly all of them.

    decide(model)                            # at load: the last layer's row-wise modules, proven on the model
    with rows(model, index, (B, T)):         # index: the flat positions (of [B * T]) the pass reads
        out = model(...)                     # exact at those positions

Which modules qualify is decided on the model itself at load (`decide`). The candidates are the last
layer's children by the names the families give their MLP (mlp, feed_forward, ffn, block_sparse_moe,
shared_mlp, mlp_block; every input of theirs laid out per position is cut to the read rows), then
its attention's output projection (o_proj, out_proj, dense, c_proj); each is kept where the model's
output at a probe's read positions comes out the same with it restricted as without. A family whose
MLP mixes positions (a convolution beside it), or whose last layer has none of these, keeps the
whole layer; so do parameters partitioned at load (ZeRO-3 init), which cannot run the probe.
"""
from contextlib import contextmanager

import torch

ROWWISE = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "shared_mlp", "mlp_block")
ATTENTION, OUTPUT = ("self_attn", "attn", "attention", "self_attention"), ("o_proj", "out_proj", "dense", "c_proj")
ATTRIBUTE = "rows_read_modules"     # set on the Hugging Face model by decide


def decoder_layers(model) -> list:
    """The model's decoder layers, in order: Transformers' checkpointable layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def last_layer(model):
    """The model's last decoder layer, or None."""
    layers = decoder_layers(model)
    return layers[-1] if layers else None


@torch.no_grad()
def decide(model, tolerance: float | None = None) -> list:
    """The last layer's modules that may run on the read rows alone (possibly none), proven on an
    8-token probe: the output at three of its positions, the last among them, with those modules
    restricted must equal the plain output. The MLP first, then the attention's output projection,
    each kept only where the probe holds with it. Stored on the model for `rows`."""
    found = []
    layer = last_layer(model)
    if layer is None or any(hasattr(p, "ds_id") for p in model.parameters()):
        setattr(model, ATTRIBUTE, found)
        return found
    attentions = [getattr(layer, name) for name in ATTENTION if isinstance(getattr(layer, name, None), torch.nn.Module)]
    groups = ([getattr(layer, name) for name in ROWWISE if isinstance(getattr(layer, name, None), torch.nn.Module)],
              [getattr(a, name) for a in attentions for name in OUTPUT if isinstance(getattr(a, name, None), torch.nn.Module)])
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    ids = (torch.arange(3, 11, device=device) * 7 % vocab)[None]                        # [1, 8]
    index = torch.tensor([2, 5, 7], device=device)
    plain = _read(model(input_ids=ids, use_cache=False).logits, index)
    if tolerance is None:
        tolerance = 1e-5 if plain.dtype == torch.float32 else 2e-2

    def holds(modules) -> bool:
        try:
            with _restricted(modules, index, tuple(ids.shape)):
                mine = _read(model(input_ids=ids, use_cache=False).logits, index)
        except Exception:                                                               # a module that needs every row
            return False
        return mine.shape == plain.shape and \
            float((mine - plain).abs().max()) / max(1.0, float(plain.abs().max())) <= tolerance

    if bool(plain.isfinite().all()) and any(groups):
        if holds(groups[0] + groups[1]):                                                # most families: one probe
            found = groups[0] + groups[1]
        else:
            for group in groups:
                if group and holds(found + group):
                    found = found + group
    setattr(model, ATTRIBUTE, found)
    return found


def _read(logits, index):
    """The output at the probe's read positions: [1, 8, k] per position, or a pooled [1, k] whole."""
    return (logits[0, index] if logits.dim() == 3 else logits).float()


@contextmanager
def rows(model, index: torch.Tensor | None, shape: tuple[int, int]):
    """While active, the modules `decide` kept for `model` run on the rows `index` (flat positions of
    the [B, T] input `shape`, in any order, repeats allowed) and give 0 elsewhere. A model without
    such modules, or no index, runs whole. `model`: the Hugging Face model (unwrapped)."""
    modules = getattr(model, ATTRIBUTE, None)
    if not modules or index is None or index.numel() == 0:
        yield
        return
    with _restricted(modules, torch.unique(index), shape):
        yield


@contextmanager
def _restricted(modules, index: torch.Tensor, shape):
    B, T = shape
    pending = []                                                                        # per call: whether it was cut

    def per_row(x):
        return torch.is_tensor(x) and x.dim() == 3 and tuple(x.shape[:2]) == (B, T)

    def before(module, args):
        cut = bool(args) and per_row(args[0])
        pending.append(cut)
        if cut:   # the hidden states, and any other per-row input (Bloom's MLP adds the residual itself)
            return tuple(x.reshape(B * T, *x.shape[2:]).index_select(0, index)[None] if per_row(x) else x
                         for x in args)                                                 # [1, n, H]
        return None

    def after(module, args, out):
        if not pending.pop():
            return None
        if torch.is_tensor(out):
            return _spread(out, index, B, T)
        if isinstance(out, tuple) and out and torch.is_tensor(out[0]):                 # (hidden, router logits ...)
            return (_spread(out[0], index, B, T),) + out[1:]
        raise TypeError(f"{type(module).__name__} returned {type(out).__name__}")

    handles = []
    try:
        for module in modules:
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        yield
    finally:
        for handle in handles:
            handle.remove()


def _spread(out, index, B: int, T: int):
    """[1, n, ...] at the rows `index` -> [B, T, ...], zeros elsewhere (differentiable)."""
    rest = out.shape[2:]
    full = out.new_zeros((B * T, *rest))
    return full.index_copy(0, index, out.reshape(-1, *rest)).view(B, T, *rest)
