"""Freed host blocks of a few MiB and more go back to the operating system (glibc's malloc).

    host_memory.return_large_blocks(4)    # early in the process, before the models load

PyTorch's CPU tensors come from malloc. glibc serves a large request from its own mapping only while
the request is above the mmap threshold, and by default it raises that threshold to the size of
each mapped block freed (up to 32 MiB). After the first step nearly every activation, gradient and
logits chunk is therefore carved from the heap, and a freed one leaves a hole that cannot be
returned while a later block sits above it: the resident memory keeps the fragmentation of every
phase. A fixed threshold gives each block of that size or more its own mapping, unmapped when
freed (and turns the adaptation off). The cost is the page faults of fresh mappings.

Measured on W3 (2-core CPU): peak RSS 1.52 -> 1.40 GB with 4 MiB in a 5-iteration run, 1.51 ->
1.45 GB in scripts/bench.py (W3 ratio to TRL 0.49x -> 0.47x); but iterations 10-15% slower (back to
back, 2 runs each: 8.7 and 7.6 s -> 9.5 and 8.9 s, system time 6 -> 14 s per run: page faults).
16 MiB: 1.49 GB; 1 MiB: 1.34 GB at 40% slower. So it is off by default: a lever for a host short of
memory (several ranks on one CPU machine), not a free gain.
With another C library (musl, macOS, Windows) this does nothing.
"""
import ctypes
import ctypes.util

import torch

M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter number (malloc.h)


def return_large_blocks(threshold_mb: float) -> bool:
    """-> whether glibc took the threshold (0 keeps its default)."""
    if threshold_mb <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold_mb * 2**20)))


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch on this rank, or without a GPU the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
