"""The [V, H] gradient blocks of a CPU update, made once per update phase and used again at each
optimizer step, not mapped and zeroed afresh at each.

glibc serves a request above its largest mmap threshold (32 MiB; plumbing/host_memory.py) from a
mapping of its own, unmapped when freed: every page of a new one is a page fault, zeroed by the
kernel. The gradients of a large vocabulary's weights are such blocks (32,768 x 256 fp32: 32 MiB and
a header; 65,536 x 512: 128 MiB), made at every micro-batch's backward and freed at every optimizer
step, so an update maps them once per optimizer step: W3's config on a 65,536 x 512 model took
260,000 page faults and 0.6-0.7 s of system time in each of the actor's and the critic's updates.

    grad_blocks.zero_grad(optim)       # optim.zero_grad(set_to_none=True), large CPU gradients kept here
    grad_blocks.zeros(weight)          # an fp32 zero block for weight's gradient: the one kept, else new
    grad_blocks.release()              # at the end of an update phase: the kept blocks go

Where the gradient is made here (head_logprobs' weight block, the lookup in head_logprobs'
tied_lookup / own_lookup), the next step's block is the last step's, zeroed in cache-warm pages, and
autograd takes it as the parameter's .grad as before (nothing else holds it then). The numbers are the
same: a block of zeros either way. Between an optimizer step and the next backward the kept block is
resident where the freed one was not (one block a model, during one micro-batch's forward): that
run's peak RSS 2.242-2.260 -> 2.242-2.285 GB (4 runs each), its step 27.18 -> 26.31 s (pooled
medians), page faults 2.2M -> 0.85M in 3 steps. Off the CPU nothing is kept (the CUDA caching
allocator reuses its blocks anyway).
"""
import sys
import weakref

import torch

MIN_BYTES = 32 << 20   # glibc's largest mmap threshold (host_memory.LARGEST_THRESHOLD_MB): smaller blocks reuse the heap

_kept: dict[int, tuple[weakref.ref, torch.Tensor]] = {}   # id(parameter) -> (the parameter, its block)


def _large(grad) -> bool:
    return grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.numel() * 4 >= MIN_BYTES


def zero_grad(optim) -> None:
    """optim.zero_grad(set_to_none=True), each large CPU gradient kept for zeros() to hand out again."""
    for group in optim.param_groups:
        for param in group["params"]:
            if param.grad is not None and _large(param.grad):
                _kept[id(param)] = (weakref.ref(param), param.grad)
    optim.zero_grad(set_to_none=True)


def zeros(weight) -> torch.Tensor:
    """A zeroed fp32 block of weight's shape for its gradient: the one zero_grad kept for it where
    nothing else holds it (then taken from here), else a new one."""
    owner, block = _kept.pop(id(weight), (None, None))
    # nothing else holds it: no other Python reference (sys.getrefcount: this name and its own argument),
    # no other tensor on it (a C++ holder, or a view of its storage: untyped_storage() holds one more)
    if (owner is not None and owner() is weight and block.shape == weight.shape and sys.getrefcount(block) == 2
            and block._use_count() == 1 and torch._C._storage_Use_Count(block.untyped_storage()._cdata) == 2):
        return block.zero_()
    del block
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def release() -> None:
    """The kept blocks go (the end of an update phase: generation and the forward passes hold no gradients)."""
    _kept.clear()
