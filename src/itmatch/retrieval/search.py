"""Query an image index: text -> images, image -> captions, and per-word attention maps.

Ranking is exact: every candidate is scored with the model's own head, and `Searcher.candidates` is the one
place that chooses the candidates (the whole collection, or a FAISS shortlist over the global embedding).
Every user input is checked here, once, for the CLI and the HTTP service alike (`QueryError` carries the HTTP
status), and unknown words are reported, never dropped silently: docs/search.md, 'Ranking', 'Unknown words'.
"""

from __future__ import annotations

import numbers
import re
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from itmatch.data.vocab import WordCoverage
from itmatch.errors import ConfigError, DataError, ItmatchError, whole_number
from itmatch.features.pipeline import UnreadableImage, decode_image
from itmatch.inference import TextBuckets, scoring_form
from itmatch.models.base import TextEmb
from itmatch.retrieval.first_stage import FirstStageIndex
from itmatch.retrieval.limits import MAX_K, MAX_PIXELS, MAX_QUERY_CHARS, MAX_QUERY_WORDS, MAX_UPLOAD_BYTES
from itmatch.retrieval.matcher import WORD_ATTENTION_MODELS
from itmatch.retrieval.names import public_id

if TYPE_CHECKING:
    from itmatch.retrieval.indexed_model import IndexedModel

IMAGE_FORMATS = frozenset({"JPEG", "PNG", "GIF", "BMP", "WEBP", "TIFF", "MPO"})
#: the way past the upload's limits (the model sees 224 x 224 pixels: a smaller photo loses nothing)
RESIZE = "resize the photo (e.g. to 1600 pixels on its longest side) or save it as JPEG, and send it again"


class QueryError(ItmatchError):
    """A bad query or upload; `status` is the HTTP status the service answers with."""

    def __init__(self, message: str, *, status: int = 422, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


def check_query(query: object) -> list[str]:
    """The words of a query that can be searched by any model (QueryError: empty, over MAX_QUERY_CHARS characters
    or MAX_QUERY_WORDS words); whether the model knows them is the Searcher's question."""
    from itmatch.data.vocab import tokenize

    if not isinstance(query, str) or not query.strip():
        raise QueryError("empty query", hint="type a few words, e.g. 'a dog jumping over a fence'")
    if len(query) > MAX_QUERY_CHARS:
        raise QueryError(f"query of {len(query)} characters exceeds the limit of {MAX_QUERY_CHARS}")
    if _undecoded_bytes(query):
        raise QueryError("the query holds bytes that are not UTF-8 text",
                         hint="send it as UTF-8 (the terminal's or the request's encoding)")
    words = tokenize(query)
    if len(words) > MAX_QUERY_WORDS:
        raise QueryError(f"query of {len(words)} words exceeds the limit of {MAX_QUERY_WORDS}")
    return words


def _undecoded_bytes(text: str) -> bool:
    """Whether `text` was decoded from bytes that are not UTF-8: Python reads such command-line arguments as lone
    surrogates (surrogateescape), the HTTP server as U+FFFD (errors="replace"). Neither is a word, and the
    tokenizer refuses surrogates with a TypeError."""
    return any(c == "\ufffd" or "\ud800" <= c <= "\udfff" for c in text)


def check_k(k: int, limit: int | None = MAX_K, lift: str = "") -> int:
    """The number of results asked for: a whole number from 1 to `limit` (MAX_K, the limit of the CLI and the HTTP
    API), or >= 1 where `limit` is None; `lift` adds to the hint how the caller may raise the limit."""
    bounds = f"between 1 and {limit}" if limit is not None else "a whole number >= 1"
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise QueryError(f"k must be {bounds.replace('between', 'a whole number between')}, got {k!r:.40}",
                         hint="ask for one result or more")
    if k < 1:
        raise QueryError(f"k must be {bounds}, got {k}", hint="ask for one result or more")
    if limit is not None and k > limit:
        raise QueryError(f"k must be {bounds}, got {k}",
                         hint=f"ask for at most {limit} results" + (f" ({lift})" if lift else ""))
    return int(k)


def open_upload(data: bytes, max_bytes: int = MAX_UPLOAD_BYTES, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Bytes of an uploaded photo -> upright RGB through the one image pipeline (`decode_image`), or
    QueryError (413 too large, 415 not an image). The format and pixel count are read from the header and
    checked before anything is decoded."""
    if not data:
        raise QueryError("empty upload", status=400, hint="send the photo's bytes as the request body")
    if len(data) > max_bytes:
        raise QueryError(f"upload of {len(data)} bytes exceeds the limit of {max_bytes}", status=413, hint=RESIZE)
    formats = "send a JPEG, PNG, GIF, BMP, WebP or TIFF photo"

    def admit(im: Image.Image) -> None:
        if im.format not in IMAGE_FORMATS:
            raise QueryError(f"unsupported image format {im.format}", status=415, hint=formats)
        w, h = im.size
        if w * h > max_pixels:
            raise QueryError(f"image of {w}x{h} pixels exceeds the limit of {max_pixels} pixels", status=413,
                             hint=RESIZE)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return decode_image(data, admit)
    except Image.DecompressionBombWarning as exc:
        raise QueryError(f"image refused as a decompression bomb ({exc})", status=413) from None
    except UnreadableImage as exc:  # PIL's limit above max_pixels, undecodable bytes, truncated files
        if isinstance(exc.__cause__, Image.DecompressionBombError):
            raise QueryError(f"image refused as a decompression bomb ({exc.__cause__})", status=413) from None
        # (PIL names the in-memory file it read, "<_io.BytesIO object at 0x...>": the upload has no name to give)
        reason = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc.__cause__)).strip()
        raise QueryError(f"not a readable image ({reason})", status=415, hint=formats) from None


def read_captions_file(path: Path | str) -> list[str]:
    """A caption collection for image-to-text search: one caption per line (blank lines ignored)."""
    path = Path(path)
    try:  # utf-8-sig: a byte-order mark (Windows Notepad writes one) is not part of the first caption
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read captions ({exc})", path=path, hint="a UTF-8 text file, one caption a line"
                        ) from None
    captions = [line.strip() for line in lines if line.strip()]
    if not captions:
        raise DataError("no captions in the file", path=path, hint="one caption a line")
    return captions


#: how a Python caller asks for more results than the HTTP API's limit (the API checks k itself, without this)
_LIFT_K = "from Python, Searcher(..., max_k=None) lifts the limit"


@dataclass
class Hit:
    id: str
    score: float
    rank: int

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "id": self.id, "score": round(self.score, 6)}


class Searcher:
    """A loaded index with the model that built it (checked), ready to answer queries.

    A Searcher is a snapshot of the index as it was when it was made: its encodings are read into memory once, so
    that photos that `build_index` adds, changes or removes later are not seen (a removed photo is still ranked,
    and `image_path` raises QueryError 404 for its file). To search the updated index, make a new Searcher;
    `itmatch serve` serves one Searcher for its lifetime, from concurrent requests, and is restarted to serve an
    update (a reload in place could hand a request the ids of one generation and the scores of another)."""

    def __init__(self, index_dir: Path | str, checkpoint: Path | str | None = None, *,
                 ensemble: Sequence[Path | str] = (), images_dir: Path | str | None = None,
                 captions: Sequence[str] | None = None,
                 verify: bool = True, shortlist: int = 0, shortlist_index: str = "flat",
                 device: str | torch.device = "cpu", precision: str = "fp32", trust_modified: bool = False,
                 max_k: int | None = MAX_K) -> None:
        """`checkpoint`: a checkpoint directory or a shipped model's name (default: the one the index records).
        `ensemble`: more indexes of the same photos, each built with another model (and searched with it): a pair's
        score is then the mean of every model's, as `itmatch evaluate` scores several checkpoints
        (docs/search.md, 'Ensembles').
        `captions`: the caption collection of `search_image`.
        `max_k`: the most results one query may ask for, MAX_K (100) by default, the limit of the CLI and the HTTP
        API (the service relies on this check); None: no limit (a query returns at most the index's images).
        `shortlist` N > 0: text queries score only the first stage's top N images (FAISS `shortlist_index`,
        flat = exact top N by the global embedding, or ivf) instead of every image; 0 = exhaustive. (With an
        ensemble: by the first index's model's global embedding.)
        The model and the index's embeddings are kept on `device` (a GPU for a service: one copy, loaded
        once), run in `precision`; scores come back to the host. `trust_modified` loads a checkpoint whose
        files differ from its manifest (the index must still have been built with the same weights, config
        and vocabulary)."""
        from itmatch.retrieval.indexed_model import ensemble_of, open_indexed_model

        # (the settings first, before the index and the model are read)
        if shortlist < 0:
            raise ConfigError(f"shortlist must be >= 0 (0 = score every image), got {shortlist}")
        if max_k is not None:
            whole_number("max_k", max_k, hint=f"leave it out for the search API's limit, {MAX_K}; None: no limit")
        if isinstance(ensemble, (str, Path)):  # (one index given bare would be read as its characters)
            ensemble = [ensemble]
        loading = dict(verify=verify, device=device, precision=precision, trust_modified=trust_modified)
        #: every model a query is scored with, the index's first; row r of each is the same photo
        self.members = ensemble_of([open_indexed_model(index_dir, checkpoint, **loading),
                                    *(open_indexed_model(other, None, **loading) for other in ensemble)])
        first = self.members[0]
        self.index, self.matcher, self.images = first.index, first.matcher, first.images
        self.model, self.vocab = self.matcher.model, self.matcher.vocab
        self.images_root = Path(images_dir) if images_dir is not None else self.index.images_root
        # the filesystem's names (what to open) and the ids they are known by outside (docs/search.md)
        self.paths = self.index.ids
        self.ids = [public_id(p) for p in self.paths]
        self.position = {i: n for n, i in enumerate(self.ids)}
        self.shortlist, self.max_k = shortlist, None if max_k is None else int(max_k)
        self.first_stage: FirstStageIndex | None = None
        if shortlist:
            if self.images.vector is None:
                raise ConfigError(f"the {self.index.manifest['model']['arch']} model has no global embedding for a "
                                  "first-stage shortlist", hint="search exhaustively (shortlist 0)")
            if self.ids:  # (an index of no photo has nothing to shortlist: a search finds nothing, and says why)
                self.first_stage = FirstStageIndex(shortlist_index).build(self.images.vector)
        self.captions = list(captions or [])
        self._caption_embs: list[TextEmb | TextBuckets] | None = None  # (per model, encoded at the first image query)
        coverages = [self._coverages(c) for c in self.captions]
        self._caption_unknown = [_unknown(c) for c in coverages]
        # scored as missing: a caption a model cannot read is never ranked (docs/search.md, 'Unknown words')
        self._rankable = torch.tensor([all(c.has_known_word for c in cs) for cs in coverages], dtype=torch.bool)
        self.captions_without_known_word = [c for c, ok in zip(self.captions, self._rankable.tolist(),
                                                                strict=True) if not ok]
        # One model computation at a time: concurrent requests would only fight over the same cores and
        # multiply the temporaries (the memory it saves under load: docs/search.md, 'Ranking').
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------------------------
    def tokens(self, query: str) -> list[str]:
        """The query's words after validation (QueryError for empty, over-long or all-unknown)."""
        return self._checked(query)[0]

    def _coverages(self, text: str) -> list[WordCoverage]:
        """How each model's vocabulary reads `text`."""
        return [member.matcher.vocab.coverage(text) for member in self.members]

    def _checked(self, query: str) -> tuple[list[str], list[WordCoverage]]:
        """The query's words and each model's vocabulary coverage, both computed once, after validation."""
        words = check_query(query)
        coverages = self._coverages(query)
        for member, coverage in zip(self.members, coverages, strict=True):
            if not coverage.has_known_word:
                unknown = _distinct(coverage.unknown)
                whose = (f"the vocabulary of the ensemble's model {member.name}" if len(self.members) > 1
                         else "the model's vocabulary")
                raise QueryError(f"none of the query's words is in {whose}"
                                 + (f" (unknown: {', '.join(unknown)})" if unknown else ""),
                                 hint="use words of the captions the model was trained on")
        return words, coverages

    def unknown_words(self, query: str) -> list[str]:
        """The query's words the model does not know (each read as <unk>, its meaning lost; with an ensemble, the
        words some model does not know), each once, in order; QueryError as `tokens` for a query that cannot be
        searched."""
        return _unknown(self._checked(query)[1])

    def encode_query(self, query: str) -> TextEmb:
        """The query as the first index's model encodes it (the one whose global embedding `candidates` reads)."""
        self.tokens(query)
        return self.matcher.encode_texts([query])

    def _encode_query(self, query: str) -> list[TextEmb]:
        """The query as each model encodes it."""
        self.tokens(query)
        return [member.matcher.encode_texts([query]) for member in self.members]

    def candidates(self, query: TextEmb) -> list[int]:
        """Rows of the index to score exactly for `query`: every row (exhaustive, the default), or the
        first stage's top `shortlist` rows by the global embedding (best first)."""
        if self.first_stage is None or self.shortlist >= len(self.ids):
            return list(range(len(self.ids)))
        if query.vector is None:
            raise ConfigError("the query has no global embedding for the first-stage shortlist")
        _, rows = self.first_stage.search(query.vector, self.shortlist)
        return [int(r) for r in rows[0] if r >= 0]  # IVF: -1 where the probed cells hold fewer

    def search(self, query: str, k: int = 10) -> list[Hit]:
        """Text -> the k best images of the index, best first (fewer when the index, or the shortlist, holds fewer).
        `k` is at most the Searcher's `max_k` (100 unless it was made with another; QueryError beyond)."""
        k = check_k(k, self.max_k, lift=_LIFT_K)
        with self._lock:
            texts = self._encode_query(query)
            rows = torch.tensor(self.candidates(texts[0]), dtype=torch.long, device=self.matcher.device)
            if len(rows) == 0:
                return []
            # all rows: score the stored embeddings as they are (take() would copy them per query)
            every = len(rows) == len(self.ids)
            scores = _mean([member.scores(member.images if every else member.images.take(rows), text)
                            for member, text in zip(self.members, texts, strict=True)])[:, 0]
        top = torch.topk(scores, min(k, len(rows)))
        return [Hit(self.ids[int(rows[i])], float(s), r + 1)
                for r, (s, i) in enumerate(zip(top.values, top.indices, strict=True))]

    def search_image(self, image: Image.Image | Path | str, k: int = 10) -> list[dict[str, Any]]:
        """Image -> the k best captions of the caption collection, best first, each with the words of it
        the model does not know. Captions without any known word are never ranked. `k` as for `search`."""
        k = check_k(k, self.max_k, lift=_LIFT_K)
        if not self.captions:
            raise QueryError("no caption collection loaded for image-to-text search", status=409,
                             hint="load one: Searcher(..., captions=[...]) from Python, --captions FILE (one "
                                  "caption a line) for `itmatch search` and `itmatch serve`")
        rankable = int(self._rankable.sum())
        if rankable == 0:
            raise QueryError(f"none of the {len(self.captions)} captions has a word in the model's vocabulary",
                             status=409, hint="load captions written in the words the model was trained on")
        with self._lock:
            if self._caption_embs is None:
                # kept as each model's head scores them, so that a photo query scores them and nothing else
                self._caption_embs = [scoring_form(member.matcher.model, member.matcher.encode_texts(self.captions))
                                      for member in self.members]
            # the photo is decoded once, and read once by each CNN the ensemble's models share (a model's photo
            # features are a function of its reading alone: matcher.photo_reading)
            photo = decode_image(image) if isinstance(image, (str, Path, bytes)) else image
            read: dict[tuple, Any] = {}
            scores = []
            for member, captions in zip(self.members, self._caption_embs, strict=True):
                reading = member.matcher.photo_reading()
                if reading not in read:
                    read[reading] = member.matcher.image_features([photo])
                scores.append(member.scores(member.matcher.encode_images(read[reading]), captions))
            scores = _mean(scores)[0]
        top = torch.topk(scores.masked_fill(~self._rankable.to(scores.device), -torch.inf), min(k, rankable))
        return [{"rank": r + 1, "caption": self.captions[int(i)], "score": round(float(s), 6),
                 "unknown_words": self._caption_unknown[int(i)]}
                for r, (s, i) in enumerate(zip(top.values, top.indices, strict=True))]

    def row_of(self, image_id: str) -> int:
        """Index row of an image id (its path relative to the photo folder, escaped by `public_id`);
        QueryError 400/404."""
        if image_id in self.position:  # before the checks: `C:x.png` or `\\x.png` may be real names
            return self.position[image_id]
        if not image_id:  # (the explain route names its own parameter: service.py)
            raise QueryError("no image id given", status=400, hint="give an image id as returned by the search")
        if (image_id.startswith(("/", "\\")) or ".." in Path(image_id).parts
                or re.match(r"^[A-Za-z]:", image_id)):  # absolute, parent, or a Windows drive
            raise QueryError(f"invalid image id '{public_id(image_id)}'", status=400,
                             hint="ids are relative paths as returned by the search")
        raise QueryError(f"no image '{public_id(image_id)}' in the index", status=404,
                         hint="ids are relative paths as returned by the search, with odd characters escaped")

    def path_of(self, image_id: str) -> Path:
        """Where an indexed image's file is: the photo folder joined with the name the filesystem gave."""
        return self.images_root / self.paths[self.row_of(image_id)]

    def image_path(self, image_id: str) -> Path:
        """The file of an indexed image, resolved inside the photo folder (never outside it); QueryError 404 with
        what to do on the server when it is not there (no server path in it: the message is a client's)."""
        root = self.images_root.resolve()
        path = self.path_of(image_id).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise QueryError(f"image '{image_id}' is not available", status=404,
                             hint=_unavailable_hint(root, path))
        return path

    @property
    def _explainer(self) -> IndexedModel | None:
        """The model whose attention `explain` draws: the first whose score attends from words to regions."""
        return next((member for member in self.members if member.has_word_attention), None)

    @property
    def explains(self) -> bool:
        """Whether `explain` has maps to give: the model's score attends from words to regions (SCAN, SAVE, OAN
        with inter-modal attention; not VSE++, MMCA, SMAN: docs/search.md, "Which map explain shows"); with an
        ensemble, one of its models' does."""
        return self._explainer is not None

    @property
    def explain_note(self) -> str | None:
        """Why results open no attention maps, for a model that has none (None when it has): the search page shows
        it under the search box and `itmatch serve` logs it."""
        if self.explains:
            return None
        if len(self.members) > 1:
            whose = f"This ensemble's models ({', '.join(member.name for member in self.members)}) all score"
        else:
            model = self.index.manifest["model"]
            whose = f"This index's model ({model.get('preset') or model.get('arch') or 'unknown'}) scores"
        return (f"{whose} a photo without attending from words to its regions, so results open no attention maps; "
                f"{WORD_ATTENTION_MODELS} draws them.")

    def explain(self, query: str, image_id: str) -> dict[str, Any]:
        """Per-word attention over the image's regions, as the model computes it for the score.

        Returns the words (with <start>/<end>, which SCAN scores as real time steps), for each word its
        weights over the grid as a [grid][grid] list (row-major, region r = cell (r // grid, r % grid)),
        the axis the weights are normalised over, the pair's score and the model that drew them (with an
        ensemble, the first of its models with word attention: the score is that model's, not the ensemble's)."""
        self.tokens(query)  # (validation: empty, over-long or all-unknown queries)
        row = self.row_of(image_id)
        member = self._explainer or self.members[0]  # (none: the model says why it cannot, a 409 below)
        try:
            with self._lock:
                attention = member.matcher.word_attention(member.images.take(slice(row, row + 1)), query)
        except ConfigError as exc:  # (a model without word attention: a conflict with this index, not bad input)
            raise QueryError(exc.message, status=409, hint=exc.hint) from None
        grid = attention.maps.shape[1]
        return {"id": image_id, "query": query, "score": round(attention.score, 6), "model": member.name,
                "grid": [grid, grid], "normalised_over": attention.normalised_over,
                "unknown_words": _distinct([t for t, k in zip(attention.tokens, attention.known, strict=True)
                                            if not k]),
                "words": [{"word": w, "known": kn, "weights": m.tolist()}
                          for w, kn, m in zip(attention.tokens, attention.known, attention.maps, strict=True)]}


def _unavailable_hint(root: Path, path: Path) -> str:
    """What to do on the server about an indexed photo whose file (`path`, resolved) is not served from `root`."""
    if not root.is_dir():
        return ("the index's photo folder is not there on the server: serve the index with --images NEW_FOLDER "
                "where it moved")
    if not path.is_relative_to(root):  # (a link replaced since indexing: `itmatch index` leaves such links out)
        return "its file on the server is now a link that leads out of the photo folder, which is never served"
    return ("its file was deleted or moved on the server since the index was made: run `itmatch index PHOTOS "
            "--model MODEL --out INDEX` again, then restart `itmatch serve`")


def _unknown(coverages: Sequence[WordCoverage]) -> list[str]:
    """The words some vocabulary reads as unknown, each once, in order."""
    return _distinct([word for coverage in coverages for word in coverage.unknown])


def _mean(scores: Sequence[torch.Tensor]) -> torch.Tensor:
    """An ensemble's scores: its models' averaged (one model: its own, as they are)."""
    return scores[0] if len(scores) == 1 else torch.stack(list(scores)).mean(0)


def _distinct(words: Sequence[str]) -> list[str]:
    """Each word once, in order of first appearance."""
    return list(dict.fromkeys(words))
