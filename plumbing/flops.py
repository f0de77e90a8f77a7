"""Model FLOPs and the device's peak, for perf/mfu (model FLOPs utilisation).

    shape = flops.shape_of(model)                 # once per model
    flops.forward(shape, lens)                    # one forward pass over sequences of these lengths
    flops.peak(device, bf16=True, tflops=0.0)     # the device's dense peak in FLOP/s, 0 if unknown

The count is the usual one (Megatron, PaLM, verl): a forward pass costs 2 FLOPs per weight of every
linear layer per token (LM head, value and score heads included) plus 4 * s^2 * (heads * head_dim)
per attention layer for a sequence of s tokens (the scores and the weighted sum, over the whole
square); a backward pass costs twice its forward. Activation recomputation and padding are not
counted: MFU measures useful work, so a faster way to the same result raises it.
"""
import dataclasses

import torch

# dense (no sparsity) peak TFLOPS from the vendors' datasheets: (bf16/fp16 tensor, tf32, fp32)
# matched against torch.cuda.get_device_name(), first match wins (so "H100 PCIe" before "H100")
GPU_PEAK_TFLOPS = [
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100", (989.4, 494.7, 66.9)),
    ("H200", (989.4, 494.7, 66.9)),
    ("H800", (989.4, 494.7, 66.9)),
    ("H20", (148.0, 74.0, 44.0)),
    ("GH200", (989.4, 494.7, 66.9)),
    ("B200", (2250.0, 1100.0, 80.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("MI300X", (1307.4, 653.7, 163.4)),
]


@dataclasses.dataclass(frozen=True)
class Shape:
    linear_weights: int   # weights of all linear layers (a tied LM head counted as a layer)
    attn_layers: int
    attn_width: int       # heads * head_dim of the queries


def shape_of(model) -> Shape:
    """Of a Hugging Face model (unwrapped from DeepSpeed/DDP), read from its modules themselves:
    their in/out features survive ZeRO-3 partitioning, and a LoRA adapter's own layers are counted
    with the base ones."""
    weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(weights, config.num_hidden_layers, heads * head_dim)


def forward(shape: Shape, lens: torch.Tensor) -> float:
    """FLOPs of one forward pass over sequences of lengths `lens` [B] (their real tokens)."""
    lens = lens.double()
    return float(2 * shape.linear_weights * lens.sum() + 4 * shape.attn_layers * shape.attn_width * (lens ** 2).sum())


def peak(device: torch.device, bf16: bool, tflops: float = 0.0) -> float:
    """The device's peak in FLOP/s for this precision: `tflops` if given, else a GPU known by name
    (fp32 matmuls count at the TF32 rate when PyTorch is allowed to use it); 0 when unknown (CPUs)."""
    if tflops > 0:
        return tflops * 1e12
    if device.type != "cuda":
        return 0.0
    known = known_gpu(torch.cuda.get_device_name(device))
    if known is None:
        return 0.0
    half, tf32, fp32 = known
    return 1e12 * (half if bf16 else tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32)


def known_gpu(name: str) -> tuple[float, float, float] | None:
    """(bf16, tf32, fp32) dense peak TFLOPS of a GPU by its device name, None if not in the table."""
    return next((peaks for key, peaks in GPU_PEAK_TFLOPS if key in name), None)
