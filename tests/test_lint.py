"""The linter: `ruff check .` with pyproject.toml's rules (each chosen there for the bugs it finds)
passes on the whole repository."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_ruff_reads_the_projects_rules(tmp_path):
    """A file with an unused import fails under the project's settings (so the check above is live)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                           str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1 and "F401" in proc.stdout
