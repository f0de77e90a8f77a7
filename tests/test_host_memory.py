"""host_memory: freed large tensors leave the process's resident memory (glibc, Linux)."""
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
took = host_memory.return_large_blocks(float(sys.argv[1]))
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


def test_zero_keeps_the_default():
    took, _ = probe(0)
    assert not took
