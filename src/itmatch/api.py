"""Python API in the spirit of open_clip: itmatch.list_models(), itmatch.list_pretrained(), itmatch.load(checkpoint),
and the photo search of the CLI's `index` and `search` verbs: itmatch.build_index(...), itmatch.Searcher(index).

The matcher itself is defined one layer down, in itmatch.retrieval.matcher, where the photo index and search
use it too (docs/architecture.md); this module is the name users import it by."""

from itmatch.pretrained import shipped
from itmatch.retrieval.index import build_index
from itmatch.retrieval.matcher import ImageInput, ImageTextMatcher, load
from itmatch.retrieval.search import Searcher


def list_pretrained() -> list[str]:
    """The names of the trained models shipped with itmatch, which `load`, `build_index` and `Searcher` take in
    place of a checkpoint directory (`itmatch models --pretrained` shows their results rows). `list_models()`
    lists presets instead: configurations to train, not weights."""
    return sorted(shipped())


__all__ = ["ImageInput", "ImageTextMatcher", "Searcher", "build_index", "list_pretrained", "load"]
