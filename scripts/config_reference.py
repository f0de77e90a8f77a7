"""Rewrite the README's config reference from train_ppo.py's Config (the source of --help too).

    python scripts/config_reference.py           # rewrite README.md in place
    python scripts/config_reference.py --check   # exit 1 if README.md is out of date
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_ppo  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{train_ppo.config_reference()}\n{END}{tail}"


if __name__ == "__main__":
    path = ROOT / "README.md"
    text = path.read_text()
    new = render(text)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if new == text else "README.md's config reference is out of date: run python scripts/config_reference.py")
    path.write_text(new)
