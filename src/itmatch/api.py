"""Python API in the spirit of open_clip: itmatch.list_models(), itmatch.load(checkpoint).

The matcher itself is defined one layer down, in itmatch.retrieval.matcher, where the photo index and search
use it too (docs/architecture.md); this module is the name users import it by."""

from itmatch.retrieval.matcher import ImageInput, ImageTextMatcher, load

__all__ = ["ImageInput", "ImageTextMatcher", "load"]
