"""itmatch: image-text matching and cross-modal retrieval (SCAN, OAN, MMCA, SAVE, SMAN and baselines)."""

from itmatch.api import ImageTextMatcher, load
from itmatch.models.registry import list_models

__version__ = "0.1.0"
__all__ = ["ImageTextMatcher", "list_models", "load", "__version__"]
