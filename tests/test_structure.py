"""The inference core (itmatch.inference) stands below engine and retrieval: it imports neither the
evaluator nor retrieval, and nothing under them imports the evaluator back (the former circles
evaluate -> two_stage -> evaluate and score_cache -> evaluate). Imports are read from the source, those
inside functions and under TYPE_CHECKING included: a deferred import is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def imported_modules(module: str) -> set[str]:
    """Every itmatch module `module` imports anywhere in its source."""
    path = SRC / (module.replace(".", "/") + ".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("itmatch"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from itmatch.engine import evaluate`
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("itmatch")}
    return {m for m in found if (SRC / (m.replace(".", "/") + ".py")).is_file()}


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


@pytest.mark.parametrize("module", ["itmatch.retrieval.two_stage", "itmatch.engine.score_cache",
                                    "itmatch.retrieval.search", "itmatch.api"])
def test_users_of_the_core_do_not_import_the_evaluator(module):
    assert "itmatch.engine.evaluate" not in reachable(module)


def test_evaluator_still_exports_the_core_it_used_to_define():
    from itmatch import inference
    from itmatch.engine import evaluate

    for name in ("encode_images", "encode_captions", "encode_caption_buckets", "score_blocks", "score_pairs",
                 "images_per_block", "bucket_texts", "unbucket_texts", "item_bytes", "MAX_BLOCK_CELLS"):
        assert getattr(evaluate, name) is getattr(inference, name), name
