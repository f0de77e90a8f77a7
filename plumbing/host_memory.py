"""How glibc's malloc hands host memory back to the operating system, set once early in the process.

    host_memory.set_malloc(0)    # the default: freed blocks stay in the process for reuse
    host_memory.set_malloc(4)    # blocks of 4 MiB and more go back to the OS when freed
    host_memory.set_malloc(-1)   # glibc's own adaptive default

PyTorch's CPU tensors come from malloc. By default glibc gives a request above its mmap threshold
its own mapping, unmapped when freed, and raises the threshold to the size of each mapped block
freed (up to 32 MiB); it also gives the top of the heap back once more than twice that is free.
A training step allocates and frees the same few hundred MB of activations, logits tiles and
gradients over and over, so with the default the kernel maps, zeroes and unmaps them again and
again: W5 at 512 tokens (scripts/bench.py's workload, 2-core CPU) took 1.5-1.7 million page faults
and 5 s of system time in a 3-step run.

- 0 (the default, `keep`): blocks up to 32 MiB (glibc's largest threshold) come from the heap, and
  the heap is not trimmed: freed memory is reused, not faulted in again. W5 at 512, 3 steps, twice
  each, alternating: page faults 1.69M / 1.54M -> 0.37M /
  0.38M, system time 5.2 / 5.0 -> 2.4 / 2.2 s, wall time 79.8 / 77.7 -> 73.6 / 68.7 s, peak RSS
  1.315 / 1.346 -> 1.352 / 1.358 GB. Blocks above 32 MiB still get their own mapping and go back.
- N > 0: blocks of N MiB and more get their own mapping and go back to the OS when freed (the
  threshold fixed): less resident memory, at the cost of those page faults. Measured on W3: peak
  RSS 1.52 -> 1.40 GB with 4 MiB, but iterations 10-15% slower (system time 6 -> 14 s per run);
  a lever for a host short of memory (several ranks on one CPU machine).
With another C library (musl, macOS, Windows) this does nothing.
"""
import ctypes
import ctypes.util

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameter numbers (malloc.h)
LARGEST_THRESHOLD_MB = 32                     # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit hosts


def set_malloc(threshold_mb: float) -> bool:
    """threshold_mb > 0: blocks of that many MiB and more go back to the OS when freed; 0: freed
    blocks stay for reuse (see above); < 0: glibc's own default, untouched. -> whether glibc took
    a setting."""
    if threshold_mb < 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    if threshold_mb > 0:
        return bool(mallopt(M_MMAP_THRESHOLD, int(threshold_mb * 2**20)))
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_THRESHOLD_MB << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch on this rank, or without a GPU the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
