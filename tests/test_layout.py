"""The tree shows the layers (docs/architecture.md): each module imports
only its own layer or lower, nothing imports train_ppo.py (it runs as __main__), and our modules
import no cycle. Read from the source with ast, without importing anything."""
import ast
import io
import re
import tokenize
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module prefix -> layer, higher = nearer the story; the longest matching prefix decides
LAYERS = {
    "train_ppo": 8,                                           # the story
    "plumbing": 7,                                            # run plumbing, one module per concern
    "distribution": 6, "rollout": 6, "rewards": 6,            # wiring, engines and weight sync, scoring
    "modeling": 5, "prompts": 5,                              # models, optimizer; prompt and SFT sets
    "forward": 4,                                             # batch layout, packing, LM head, readouts
    "config": 3,                                              # the Config, its sources and validation
    "core_algos": 2, "kl": 2,                                 # the math: tensors in, tensors out
    "errors": 1,                                              # UserError, raised at every layer
    "plumbing.console": 1, "plumbing.lean_imports": 1,        # leaves any layer may call: they import nothing of ours
    "plumbing.flops": 1,                                      # (forward.packing weighs its FLOPs)
}
TOOLS = ("scripts", "examples", "tests")   # outside the layers: may import any layer, but never the script's module
OURS = {key.split(".")[0] for key in LAYERS} | set(TOOLS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int | None:
    matches = [key for key in LAYERS if module == key or module.startswith(key + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def imports(path: Path, module: str) -> set[str]:
    """Our modules that `path` imports (at any depth: lazy imports inside functions count too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from package import module` imports the submodule where one exists
            names = [f"{base}.{a.name}" if (ROOT / base.replace(".", "/") / f"{a.name}.py").exists()
                     or (ROOT / base.replace(".", "/") / a.name / "__init__.py").exists() else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in OURS}
    return found


def graph() -> dict[str, set[str]]:
    # the repository's files, tracked or new, not what .gitignore keeps out (runs/, virtual environments, ...)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / p for p in listed if (ROOT / p).is_file()]
    return {module_name(p): imports(p, module_name(p)) for p in files}


GRAPH = graph()


def test_the_layers_cover_every_module_outside_the_tools():
    unplaced = [m for m in GRAPH if layer(m) is None and m.split(".")[0] not in TOOLS]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_nothing_imports_the_script():
    # tests may drive the script's own functions (setup, train_step); no module of the toolkit may
    offenders = [m for m, deps in GRAPH.items() if "train_ppo" in deps and not m.startswith("tests")]
    assert not offenders, f"these import train_ppo (it runs as __main__; a second copy would load): {offenders}"


def test_each_module_imports_only_its_own_layer_or_lower():
    bad = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})" for m, deps in sorted(GRAPH.items())
           if layer(m) is not None for d in sorted(deps) if layer(d) is not None and layer(d) > layer(m)]
    assert not bad, "\n".join(bad)


def test_the_leaves_import_nothing_of_ours():
    leaves = [m for m in GRAPH if layer(m) == 1]
    assert {m: GRAPH[m] for m in leaves if GRAPH[m]} == {}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_our_modules_import_no_cycle():
    edges = {m: {d for d in deps if d in GRAPH and d != m} for m, deps in GRAPH.items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


@pytest.mark.parametrize("module, imported", [("core_algos", "config"), ("config", "forward.batch"),
                                              ("forward.readouts", "modeling.loading"), ("plumbing.checkpoints", "train_ppo")])
def test_the_check_fails_on_an_upward_import(module, imported):
    assert layer(imported) > layer(module)   # what test_each_module_imports_only_its_own_layer_or_lower rejects


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


# What points outside the repository: a path that climbs out of a directory (paths here are written
# from the repository's root, so any climb leaves it), or a Markdown file named by a path or a bare
# name that no file in the repository has. Web addresses are not paths. In Python
# files the prose is read (docstrings and comments): string literals are data, such as a run's
# output paths.
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
CLIMB = re.compile(r"(?:\.\./)+[\w./-]*")
MD_NAME = re.compile(r"[\w./-]*\w\.md\b")


def outside_references(path: str, text: str, md_files: set[str]) -> list[str]:
    """The references in `text` (the file at repository path `path`) to files outside the repository."""
    text, found = URL.sub(" ", text), []
    found += CLIMB.findall(text)
    names = {Path(p).name for p in md_files}
    for ref in MD_NAME.findall(text):
        ref = ref.lstrip("./") if not ref.startswith("../") else ref
        if ref not in md_files and Path(ref).name not in names and ref not in found:
            found.append(ref)
    return found


def prose(path: str, text: str) -> str:
    """What a person reads as a reference: the whole of a text file; a Python file's docstrings and comments."""
    if not path.endswith(".py"):
        return text
    tree = ast.parse(text)
    docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    return "\n".join(docs + comments)


def repository_files() -> list[str]:
    return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.split()


def test_nothing_in_the_repository_points_outside_it():
    files = [p for p in repository_files() if (ROOT / p).is_file()]
    md_files = {p for p in files if p.endswith(".md")}
    bad = []
    for p in files:
        try:
            text = (ROOT / p).read_text()
        except UnicodeDecodeError:   # model weights, parquet: not text
            continue
        bad += [f"{p}: {ref}" for ref in outside_references(p, prose(p, text), md_files)]
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)


def test_the_outside_reference_check_reads_python_prose_only():
    code = '"""W1 (../shared/benchmarks.md)."""\nCARD = "../curves.png"  # a run\'s output, not a reference\n'
    assert outside_references("x.py", prose("x.py", code), set()) == ["../shared/benchmarks.md"]


def test_the_outside_reference_check_finds_them():
    md = {"README.md", "docs/benchmarks.md"}
    assert outside_references("scripts/bench.py", "W1 (../shared/benchmarks.md)", md) == ["../shared/benchmarks.md"]
    assert outside_references("core_algos.py", "see shared algorithms.md", md) == ["algorithms.md"]
    assert outside_references("docs/x.md", "[W1](benchmarks.md), README.md, https://h.io/a/design.md", md) == []
