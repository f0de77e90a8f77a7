"""host_memory: freed large tensors leave the process's resident memory, or stay for reuse (glibc, Linux)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, torch
from plumbing import host_memory
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
took = host_memory.set_malloc(float(sys.argv[1]))
keep, start = [], rss_mib()
for _ in range(3):
    big = [torch.ones(2 << 20) for _ in range(16)]   # 16 x 8 MiB
    keep.append(torch.ones(1000))                    # a small block allocated after them, still alive
    del big
print(took, rss_mib() - start)
"""


def probe(threshold_mb: float) -> tuple[bool, float]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(threshold_mb)], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    took, grown = proc.stdout.split()
    return took == "True", float(grown)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_tensors_leave_resident_memory():
    """3 x 128 MiB allocated and freed, with live small blocks above them on the heap: with the
    threshold the process ends within a few MiB of where it started (with glibc's adaptive default
    it keeps about 140 MiB here)."""
    took, grown = probe(4)
    assert took
    assert grown < 16, f"{grown:.0f} MiB still resident"


REUSE = """
import resource, sys, torch
from plumbing import host_memory
took = host_memory.set_malloc(0) if sys.argv[1] == "set" else None
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big = [torch.ones(2 << 20) for _ in range(16)]   # 16 x 8 MiB, written: 32,768 pages
    del big                                          # nothing above them: glibc's default trims them away
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, *faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_zero_keeps_freed_blocks_for_reuse():
    """The default: 128 MiB allocated, written and freed three times; the freed blocks stay in the
    process, so the second and third rounds reuse them without page faults (glibc's own default
    gives them back at each free and faults all 32,768 pages in again each round)."""
    proc = subprocess.run([sys.executable, "-c", REUSE, "set"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    took, *faults = proc.stdout.split()
    first, *later = map(int, faults)
    assert took == "True"
    assert first > 30_000 and sum(later) < first, faults   # mostly reused (0-14k seen); each round fresh: 2x first
