"""perf/mfu's FLOP count (flops.py) against PyTorch's own FLOP counter on real forward passes."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from plumbing import flops


def config(**kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128,
                attn_implementation="eager")   # its attention is two matmuls, which FlopCounterMode counts
    return Qwen2Config(**{**base, **kw})


def counted(model, ids):
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    return counter.get_total_flops()


@pytest.mark.parametrize("make,kw", [(Qwen2ForCausalLM, {}), (Qwen2ForCausalLM, {"tie_word_embeddings": True}),
                                     (Qwen2ForCausalLM, {"head_dim": 24}),
                                     (Qwen2ForTokenClassification, {"num_labels": 1})])
@pytest.mark.parametrize("batch,seq", [(1, 37), (3, 16)])
def test_forward_flops_equal_what_pytorch_counts(make, kw, batch, seq):
    """Every matmul of a forward pass (projections, MLP, head, attention scores and weighted sum)
    is in the count, at any sequence length (the attention term grows with its square)."""
    torch.manual_seed(0)
    model = make(config(**kw)).eval()
    ids = torch.randint(0, 300, (batch, seq))
    expected = counted(model, ids)
    assert flops.forward(flops.shape_of(model), torch.full((batch,), seq)) == pytest.approx(expected, rel=1e-9)


def test_a_lora_adapter_is_counted_with_its_base():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(config()), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 300, (2, 20))
    assert flops.forward(flops.shape_of(model), torch.full((2,), 20)) == pytest.approx(counted(model, ids), rel=1e-9)


def test_peak_is_the_given_figure_else_unknown_on_cpu():
    cpu = torch.device("cpu")
    assert flops.peak(cpu, bf16=False, tflops=0.25) == 0.25e12
    assert flops.peak(cpu, bf16=True) == 0.0


def test_gpu_names_find_their_own_row():
    """First match wins: a PCIe H100 and an H20 must not take the H100 SXM's or H200's figures."""
    rows = dict(flops.GPU_PEAK_TFLOPS)
    for name, key in [("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H20", "H20"),
                      ("NVIDIA H200", "H200"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
                      ("NVIDIA A100-SXM4-80GB", "A100")]:
        assert flops.known_gpu(name) == rows[key], name
    assert flops.known_gpu("Some Future GPU") is None
