"""itmatch: image-text matching and cross-modal retrieval (SCAN, OAN, MMCA, SAVE, SMAN and baselines)."""

from itmatch.api import ImageTextMatcher, Searcher, build_index, list_pretrained, load
from itmatch.models.registry import list_models

__version__ = "0.1.0"
__all__ = ["ImageTextMatcher", "Searcher", "build_index", "list_models", "list_pretrained", "load", "__version__"]
