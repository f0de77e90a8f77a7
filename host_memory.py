"""Freed host blocks of a few MiB and more go back to the operating system (glibc's malloc).

    host_memory.return_large_blocks(4)    # early in the process, before the models load

PyTorch's CPU tensors come from malloc. glibc serves a large request from its own mapping only while
the request is above the mmap threshold, and by default it raises that threshold to the size of
each mapped block freed (up to 32 MiB). After the first step nearly every activation, gradient and
logits chunk is therefore carved from the heap, and a freed one leaves a hole that cannot be
returned while a later block sits above it: the resident memory keeps the fragmentation of every
phase. A fixed threshold gives each block of that size or more its own mapping, unmapped when
freed (and turns the adaptation off). The cost is the page faults of fresh mappings.

Measured on W3 (2-core CPU, 5 iterations, median iteration, peak RSS of the process): glibc's
default 7.4 s, 1.52 GB; 16 MiB 7.8 s, 1.49 GB; 4 MiB 7.9 s, 1.40 GB; 1 MiB 10.6 s, 1.34 GB.
With another C library (musl, macOS, Windows) this does nothing.
"""
import ctypes
import ctypes.util

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
