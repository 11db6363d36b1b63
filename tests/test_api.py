"""The Python API's names (README, 'Python API'): what a user imports from `itmatch`."""

from __future__ import annotations

import itmatch
from itmatch.pretrained import shipped


def test_the_package_exports_loading_listing_indexing_and_search():
    assert {"load", "list_models", "list_pretrained", "build_index", "Searcher", "ImageTextMatcher"} <= set(
        itmatch.__all__)
    assert all(callable(getattr(itmatch, name)) for name in itmatch.__all__ if name != "__version__")


def test_list_pretrained_names_the_shipped_models_and_list_models_the_presets():
    """A user took `list_models()` for the names `load` takes: it lists presets, `list_pretrained()` the weights."""
    assert itmatch.list_pretrained() == sorted(shipped()) and itmatch.list_pretrained()
    assert not set(itmatch.list_pretrained()) & set(itmatch.list_models())
    assert itmatch.load(itmatch.list_pretrained()[0]).model.training is False
