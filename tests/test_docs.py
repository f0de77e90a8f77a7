"""The docs' config reference and --help come from the Config dataclass; they cannot drift."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import forkserver
from plumbing import config_docs
import config

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_reference_is_current():
    proc = forkserver.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_help_lists_every_key_once_under_a_section():
    proc = forkserver.run([sys.executable, str(ROOT / "train_ppo.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    names = [f.name for f in dataclasses.fields(config.Config)]
    listed = [line.split()[0][2:] for line in proc.stdout.splitlines() if line.startswith("  --")]
    assert sorted(listed) == sorted(names)
    sections = config_docs.sections(config.Config)
    assert len(sections) >= 10 and all(fields for _, fields in sections)


def test_trl_table_points_at_real_keys_or_says_why_not():
    sys.path.insert(0, str(ROOT / "scripts"))
    import config_reference
    keys = {f.name for f in dataclasses.fields(config.Config)}
    for field, (key, how) in config_reference.TRL_FIELDS.items():
        assert key in keys if key else how, field


def test_the_docs_build_with_no_broken_link_or_missing_page(tmp_path):
    """mkdocs.yml's strict validation fails the build on a link to a missing page or anchor and on
    a page left out of the navigation."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "config-reference" / "index.html").is_file()


def test_the_readme_links_only_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert links and all((ROOT / link).is_file() for link in links), [link for link in links if not (ROOT / link).is_file()]
