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

Peak memory per phase (perf/peak_rss_gb/<phase>, on CUDA also perf/peak_cuda_gb/<phase>):

    with host_memory.PEAKS.phase("gen", into=times): ...   # train_ppo.py's timed() does this
    host_memory.PEAKS.run_peaks()   # the run's peak so far, every phase and the time between them

A phase's host peak needs the process's high-water mark (VmHWM) reset at its start, which Linux
does through /proc/self/clear_refs ("5"). That mark is also what getrusage's ru_maxrss and wait4
report, so after a reset they no longer hold the run's peak: before each reset the mark is read
and folded into the run's peak and into every phase open around it (nested phases stay right), and
peak_memory_gb() and scripts/bench.py read that. On CUDA the allocator's peak
(torch.cuda.max_memory_allocated) is handled the same way with torch.cuda.reset_peak_memory_stats.

The frozen models' weights, mapped from their safetensors files, leave the resident set between their
passes, and during a pass each layer's as soon as it has run (train_ppo.py runs the reward model's and
the reference's passes so):

    host_memory.release_file_pages(run.ref)    # -> bytes dropped; the page cache keeps them
    with host_memory.frozen_pass(run.ref): ... # per layer during the pass, the whole model after it

and so do the libraries' pages that imports and setup read and the steps do not (W3: 177 -> 53 MB of
file pages through the steps, the run's peak 1.25 -> 1.08 GB):

    host_memory.release_code_pages()           # once, at the end of setup
"""
import functools
import os
import sys
from contextlib import contextmanager
import ctypes
import ctypes.util

import numpy as np
import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameter numbers (malloc.h)
LARGEST_THRESHOLD_MB = 32                     # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit hosts


@functools.cache
def _libc():
    """The C library (raises OSError where there is none to load), looked up once: find_library runs
    ldconfig in a subprocess, a fork of the whole process (4-6 ms at W3's size), and frozen_pass
    releases pages after every layer of every micro-batch."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def set_malloc(threshold_mb: float) -> bool:
    """threshold_mb > 0: blocks of that many MiB and more go back to the OS when freed; 0: freed
    blocks stay for reuse (see above); < 0: glibc's own default, untouched. -> whether glibc took
    a setting."""
    if threshold_mb < 0:
        return False
    try:
        libc = _libc()
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    if threshold_mb > 0:
        return bool(mallopt(M_MMAP_THRESHOLD, int(threshold_mb * 2**20)))
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_THRESHOLD_MB << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


GB = 1e9   # the metrics' unit, as scripts/bench.py reports peak RSS


def _host_peak() -> float:
    """The process's resident high-water mark in bytes: VmHWM on Linux, else getrusage's ru_maxrss."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _reset_host_peak() -> bool:
    """VmHWM back to the current resident size (Linux 4.0+) -> whether it was."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _cuda_peak() -> float:
    return float(torch.cuda.max_memory_allocated()) if torch.cuda.is_initialized() else 0.0


def _reset_cuda_peak() -> bool:
    if torch.cuda.is_initialized():   # resetting before CUDA's first use would initialise it
        torch.cuda.reset_peak_memory_stats()
    return True


class PhasePeaks:
    """Each phase's peak memory, and the run's; one per process (PEAKS), as the marks it resets are."""

    def __init__(self):
        self.meters = {"perf/peak_rss_gb": (_host_peak, _reset_host_peak)}
        if torch.cuda.is_available():
            self.meters["perf/peak_cuda_gb"] = (_cuda_peak, _reset_cuda_peak)
        self.run = dict.fromkeys(self.meters, 0.0)    # bytes, the run's peak up to the last reset
        # whether each mark can be reset (no per-phase figure where it cannot)
        self.resets = {key: key != "perf/peak_rss_gb" or os.access("/proc/self/clear_refs", os.W_OK)
                       for key in self.meters}
        self.open: list[dict] = []                    # the phases running now, innermost last: key -> bytes
        self.before_phases: dict | None = None        # the run's peak before its first phase (setup)

    def _fold(self) -> None:
        """Each mark since its last reset -> the run's peak and every open phase's; then reset it."""
        for key, (read, reset) in self.meters.items():
            peak = read()
            self.run[key] = max(self.run[key], peak)
            for window in self.open:
                window[key] = max(window.get(key, 0.0), peak)
            if self.resets[key]:
                self.resets[key] = reset()

    @contextmanager
    def phase(self, name: str, into: dict):
        """into[f"{key}/{name}"]: the peak while the block ran, in GB (the larger one if the phase ran
        before in this step); NaN where the mark cannot be reset (no per-phase figure then)."""
        self._fold()
        if self.before_phases is None:
            self.before_phases = dict(self.run)
        window: dict = {}
        self.open.append(window)
        try:
            yield
        finally:
            self._fold()
            self.open.pop()   # phases nest: this one is the innermost
            for key in self.meters:
                value = window.get(key, 0.0) / GB if self.resets[key] else float("nan")
                into[f"{key}/{name}"] = max(into.get(f"{key}/{name}", value), value)

    def run_peaks(self) -> dict:
        """key -> the run's peak so far in GB, up to now."""
        return {key: max(self.run[key], read()) / GB for key, (read, _) in self.meters.items()}

    def of_step(self, times: dict) -> dict:
        """A step's figures: each phase's peak (phase() wrote them into times), the run's so far and what
        the process held at most before its first phase (<key>/setup: the same every step, so that every
        step logs the same keys)."""
        out = {k: v for k, v in times.items() if k.startswith(tuple(self.meters))}
        out.update(self.run_peaks())
        if self.before_phases is not None:
            out.update({f"{key}/setup": peak / GB for key, peak in self.before_phases.items()})
        return out


PEAKS = PhasePeaks()


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch on this rank, or without a GPU the process's peak RSS, in GiB,
    over the whole run (PEAKS keeps it across the per-phase resets)."""
    key = "perf/peak_cuda_gb" if torch.cuda.is_available() else "perf/peak_rss_gb"
    return PEAKS.run_peaks()[key] * GB / 2**30


MADV_DONTNEED = 4   # Linux madvise advice: drop the range's pages from this process (file pages stay cached)


def _private_file_mappings(read_only: bool = False) -> list[tuple[int, int]]:
    """(start, end) of this process's private mappings of files, from /proc/self/maps (read_only:
    those mapped without write permission alone)."""
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if (len(fields) == 6 and fields[1].endswith("p") and fields[5].startswith("/")
                    and not (read_only and "w" in fields[1])):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                regions.append((start, end))
    return regions


def _file_pages(start: int, end: int) -> int | None:
    """The bytes of [start, end) resident as the file's own pages, from /proc/self/pagemap; None
    where any page is the process's own (present but not a file page: copied on write; or swapped)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // page * 8)
        entries = np.frombuffer(pagemap.read((end - start) // page * 8), dtype=np.uint64)
    present, swapped, file = ((entries >> np.uint64(bit)) & np.uint64(1) for bit in (63, 62, 61))
    if swapped.any() or (present & ~file & np.uint64(1)).any():
        return None
    return int(present.sum()) * page


def release_file_pages(*modules) -> int:
    """Drops from this process's resident memory the pages of the modules' weights that are still
    the files' own: -> the bytes dropped. Transformers loads safetensors weights by mapping the file
    (private, copy-on-write), so a frozen model's weights (the reference, the reward model) are
    page-cache pages that the process maps, counted in its resident size although nothing was ever
    written to them. Between their passes nothing reads them: madvise(MADV_DONTNEED) unmaps them,
    the page cache keeps them (the kernel may reclaim them without writing anything), and the next
    pass maps them again from the cache, minor page faults, the same bytes. Only a mapping none of
    whose pages was written qualifies (/proc/self/pagemap: every present page a file page; a page
    copied on write would be lost, so trained weights are never touched), and only where the
    weights lie in a file mapping: converted weights (another dtype), DeepSpeed's partitions and GPU
    tensors are the process's own memory and stay. Linux only; elsewhere nothing is done (0)."""
    if sys.platform != "linux":
        return 0
    pointers = {t.untyped_storage().data_ptr() for m in modules if m is not None
                for t in (*m.parameters(), *m.buffers()) if t.device.type == "cpu" and t.numel()}
    if not pointers:
        return 0
    try:
        return _drop_mappings([(start, end) for start, end in _private_file_mappings()
                               if any(start <= p < end for p in pointers)])
    except (OSError, AttributeError):   # no /proc (a sandbox), no libc
        return 0


def _drop_mappings(regions: list[tuple[int, int]]) -> int:
    """madvise(MADV_DONTNEED) on each whole mapping whose resident pages are all the file's own -> the
    bytes dropped."""
    madvise = _libc().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, end in regions:
        resident = _file_pages(start, end)
        if resident and madvise(start, end - start, MADV_DONTNEED) == 0:
            dropped += resident
    return dropped


def release_code_pages() -> int:
    """Drops from this process's resident memory the pages of its read-only file mappings that are
    still the files' own: -> the bytes dropped. Those are the shared libraries' code and constant
    data above all (PyTorch's, pyarrow's, the tokenizers', ...). Importing them and setting up a run
    (loading the models, reading the prompts' parquet, starting MLflow) touches far more of them than
    the steps run: W3's process held 177 MB of them through its steps, of which the steps use about
    53. The rest are page-cache pages this process only maps, counted in its resident size although
    nothing reads them again. madvise(MADV_DONTNEED) unmaps them; the page cache keeps them, and a
    page that is read again comes back from it (a minor page fault), the same bytes. Called once,
    after setup. As in release_file_pages, a mapping qualifies only where every present page is a
    file page: a read-only mapping that was written before it was made read-only (a library's
    relocated data, RELRO) holds pages of the process's own and is left alone. Linux only;
    elsewhere, or without /proc, nothing is done (0)."""
    if sys.platform != "linux":
        return 0
    try:
        return _drop_mappings(_private_file_mappings(read_only=True))
    except (OSError, AttributeError):   # no /proc (a sandbox), no libc
        return 0


def _release_pages(tensors, regions: list[tuple[int, int]]) -> int:
    """release_file_pages for part of a mapping: the whole pages inside each tensor's storage that lie in
    one of `regions` (private file mappings) and are all still the file's own -> the bytes dropped."""
    page, dropped = os.sysconf("SC_PAGE_SIZE"), 0
    try:
        madvise = _libc().madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for t in tensors:
            storage = t.untyped_storage()
            start = -(-storage.data_ptr() // page) * page                              # the pages wholly its own
            end = (storage.data_ptr() + storage.nbytes()) // page * page
            if t.device.type == "cpu" and end > start and any(lo <= start and end <= hi for lo, hi in regions):
                resident = _file_pages(start, end)
                if resident and madvise(start, end - start, MADV_DONTNEED) == 0:
                    dropped += resident
    except (OSError, AttributeError):                                                  # no pagemap, no libc
        pass
    return dropped


@contextmanager
def frozen_pass(model):
    """A frozen model's pass (the reward model's scoring, the reference's log-probs): the weights of its
    input embedding and of each decoder layer leave the resident set as soon as that module has run
    (release_file_pages' pages, cut at tensor boundaries inside the one mapping of the file), and the
    whole model's after the pass. The pass then holds one module's weights at a time, not the model's:
    W3's scoring and forward passes peaked at the heap plus a whole frozen model (about 45 MB), now
    plus its [32768, 256] embedding (34 MB), which the reference's LM head (tied) maps again anyway.
    A model of none (a reward function), or one whose weights are not file pages, runs as it is."""
    if model is None or sys.platform != "linux":
        yield
        return
    from forward.last_layer import decoder_layers
    from forward.readouts import _unwrap
    inner = _unwrap(model)                                                             # DeepSpeed / DDP wrappers
    try:
        regions = _private_file_mappings()
    except OSError:                                                                    # no /proc (a sandbox)
        regions = []

    def after(module, args, out):
        _release_pages([*module.parameters(), *module.buffers()], regions)

    embedding = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    modules = ([embedding] if isinstance(embedding, torch.nn.Module) else []) + decoder_layers(inner)
    handles = [m.register_forward_hook(after) for m in modules] if regions else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        release_file_pages(model)
