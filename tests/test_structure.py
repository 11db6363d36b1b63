"""The layers of docs/architecture.md, enforced on the import graph: a module imports only from its own
layer or the layers below it (models <- inference <- engine/retrieval <- api <- cli, with data, features,
io, device and the other foundations at the bottom), and the graph has no circles, except the upward imports
and circles that exist today, each listed below with what will remove it (an entry that no longer holds fails
too, so the lists only shrink). The inference core (itmatch.inference) imports neither the
evaluator nor retrieval, and nothing under them imports the evaluator back (the former circles
evaluate -> two_stage -> evaluate and score_cache -> evaluate). Imports are read from the source, those
inside functions and under TYPE_CHECKING included: a deferred import is still a circle."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def source_file(module: str) -> Path | None:
    """The file of an itmatch module or subpackage (its __init__.py); None for the root package `itmatch`, the
    public facade (it re-exports the API), and for names that are not modules (a function imported by name)."""
    base = SRC / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if module != "itmatch" and path.is_file():
            return path
    return None


@functools.cache
def imported_modules(module: str) -> frozenset[str]:
    """Every itmatch module `module` imports anywhere in its source."""
    path = source_file(module)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("itmatch"):
            # `from itmatch.engine import evaluate` imports the module itmatch.engine.evaluate; a name that is not
            # a module comes from node.module itself
            submodules = {f"{node.module}.{a.name}" for a in node.names}
            found |= {m for m in submodules if source_file(m) is not None}
            if any(source_file(m) is None for m in submodules):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("itmatch")}
    return frozenset(m for m in found if source_file(m) is not None and m != module)


def reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for m in imported_modules(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_inference_core_imports_neither_the_evaluator_nor_retrieval():
    below = reachable("itmatch.inference")
    assert not {m for m in below if m.startswith(("itmatch.retrieval", "itmatch.api"))}, below
    assert "itmatch.engine.evaluate" not in below and "itmatch.engine.train" not in below


@pytest.mark.parametrize("module", ["itmatch.retrieval.two_stage", "itmatch.inference.score_cache",
                                    "itmatch.retrieval.search", "itmatch.retrieval.matcher", "itmatch.api"])
def test_users_of_the_core_do_not_import_the_evaluator(module):
    assert "itmatch.engine.evaluate" not in reachable(module)


def test_import_itmatch_leaves_nltk_until_a_caption_is_tokenized():
    """nltk's package import took 2.3 s of `import itmatch`'s 5 (a user trial); only tokenizing needs it."""
    import subprocess
    import sys

    code = ("import sys, itmatch; a = 'nltk' in sys.modules; from itmatch.data.vocab import tokenize; "
            "print(a, tokenize('A dog.'), 'nltk' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "['a',", "'dog',", "'.']", "True"]


def test_evaluator_still_exports_the_core_it_used_to_define():
    from itmatch import inference
    from itmatch.engine import evaluate

    for name in ("encode_images", "encode_captions", "encode_caption_buckets", "score_blocks", "score_pairs",
                 "images_per_block", "bucket_texts", "unbucket_texts", "item_bytes", "MAX_BLOCK_CELLS"):
        assert getattr(evaluate, name) is getattr(inference, name), name


# -- the layers ----------------------------------------------------------------------------------------------

#: bottom to top; a module belongs to the first layer one of whose prefixes names it or a package above it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("itmatch.errors", "itmatch.io", "itmatch.device", "itmatch.distributed", "itmatch.fingerprint",
                    "itmatch.config", "itmatch.argtypes", "itmatch.data", "itmatch.features")),
    ("models", ("itmatch.models",)),
    ("inference", ("itmatch.inference",)),
    ("engine/retrieval", ("itmatch.engine", "itmatch.retrieval", "itmatch.pretrained")),
    ("api", ("itmatch.api", "itmatch.analysis", "itmatch.demo")),
    ("cli", ("itmatch.cli", "itmatch.__main__")),
]

#: upward imports that exist today (importer, imported) -> what removes it (docs/architecture.md): none left
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
#: circles that exist today, each as the sorted list of its modules: none left
KNOWN_CIRCLES: list[list[str]] = []


def all_modules() -> list[str]:
    names = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "itmatch":
            names.append(name)
    return names


def layer_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to docs/architecture.md")


def upward_imports() -> set[tuple[str, str]]:
    return {(m, dep) for m in all_modules() for dep in imported_modules(m) if layer_of(dep) > layer_of(m)}


def circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = {m: imported_modules(m) for m in all_modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    return sorted(found)


def test_every_module_is_in_a_layer():
    for m in all_modules():
        layer_of(m)


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports() == set(KNOWN_UPWARD), (
        "new upward imports (move the code down, or the import up): "
        f"{sorted(upward_imports() - set(KNOWN_UPWARD))}; "
        f"fixed ones to drop from KNOWN_UPWARD: {sorted(set(KNOWN_UPWARD) - upward_imports())}")


def test_no_import_circles():
    assert circles() == KNOWN_CIRCLES


def test_the_layer_checker_sees_a_planted_upward_import_and_circle(monkeypatch):
    """The checks above can fail: a foundation module importing the CLI is an upward import and a circle."""
    real = imported_modules

    def planted(module: str) -> set[str]:
        return real(module) | ({"itmatch.cli"} if module == "itmatch.io" else set())

    monkeypatch.setattr(__import__(__name__), "imported_modules", planted)
    assert ("itmatch.io", "itmatch.cli") in upward_imports()
    assert any("itmatch.io" in c and "itmatch.cli" in c for c in circles())


def test_the_image_pipeline_is_the_only_decoder():
    """Extraction, the index, the API and pixel-input data decode images through features/pipeline.py only."""
    for module in ("itmatch.features.extract_split", "itmatch.retrieval.index", "itmatch.retrieval.matcher",
                   "itmatch.data.images"):
        assert "Image.open(" not in source_file(module).read_text(encoding="utf-8"), module
        assert "itmatch.features.pipeline" in imported_modules(module), module
