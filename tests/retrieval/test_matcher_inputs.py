"""ImageTextMatcher's inputs (a new user's trial of the Python API): what rank() reads as an image, empty and
single-image inputs, one image for word_attention, precomputed features checked against the model, bad arguments
refused before any work, and load(backbone=) against the backbone the model was trained on."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from conftest import SHARED, make_precomp
from PIL import Image

import itmatch
from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
from itmatch.engine.train import prepare_data
from itmatch.errors import ConfigError, DataError, UnknownWordsWarning
from itmatch.features.pipeline import IMAGE_SUFFIXES
from itmatch.models.registry import build_model, resolve_config
from itmatch.retrieval.matcher import ImageTextMatcher

CAPTIONS = ["a dog runs on the grass", "a girl climbs the stairs"]


@pytest.fixture(scope="module")
def shipped() -> ImageTextMatcher:
    """The shipped VSE++ model of Lite0 features (its CNN loads once, at the first photo)."""
    return itmatch.load("vsepp-flickr8k")


def fresh() -> ImageTextMatcher:
    """A matcher whose backbone has not been loaded: one still unloaded after a call read no photo."""
    return itmatch.load("vsepp-flickr8k")


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, object]:
    """Two small synthetic photos: a JPEG and a WebP file, the WebP's bytes, and a PNG under a name without an
    image extension."""
    root = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    a = Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8))
    b = Image.fromarray(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8))
    a.save(root / "a.jpg")
    b.save(root / "b.webp")
    buffer = io.BytesIO()
    b.save(buffer, format="PNG")
    (root / "no_extension").write_bytes(buffer.getvalue())
    return {"root": root, "jpg": root / "a.jpg", "webp": root / "b.webp", "plain": root / "no_extension",
            "webp_bytes": (root / "b.webp").read_bytes()}


# -- 1. rank(): image or text ---------------------------------------------------------------------------------


def test_the_image_extensions_are_the_indexs():
    """One list: the photos `itmatch index` takes from a folder are the str queries rank() reads as photos."""
    assert {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"} == IMAGE_SUFFIXES
    assert "IMAGE_SUFFIXES" in ImageTextMatcher.rank.__doc__ and "query_kind" in ImageTextMatcher.rank.__doc__


def test_a_webp_path_is_an_image_query_and_a_file_without_a_photo_ending_needs_query_kind(shipped, pictures,
                                                                                          monkeypatch):
    """A .webp path was read as words ("none of the query's words is in the model's vocabulary"); a caption that is
    also a file's name (a file named dog beside the program) stays a caption."""
    expected = shipped.score([pictures["webp"]], CAPTIONS)[0]
    for query in (str(pictures["webp"]), pictures["webp"], pictures["webp_bytes"]):
        ranked = shipped.rank(query, CAPTIONS, top_k=2)
        assert sorted(i for i, _ in ranked) == [0, 1]
        assert {i: s for i, s in ranked} == pytest.approx({i: float(expected[i]) for i in range(2)}, abs=1e-5)
    # a file without a photo's ending is a photo when said so; a caption that names a file stays a caption
    assert len(shipped.rank(str(pictures["plain"]), CAPTIONS, top_k=1, query_kind="image")) == 1
    monkeypatch.chdir(pictures["root"])
    (pictures["root"] / "dog").write_text("not a photo")
    photos = [pictures["jpg"], pictures["webp"]]
    assert shipped.rank("dog", photos, top_k=2) == shipped.rank("dog", photos, top_k=2, query_kind="text")


def test_a_missing_image_path_says_not_found_and_how_to_pass_text(shipped, tmp_path):
    for query in (str(tmp_path / "x.webp"), "logo.png", "a dog.JPG"):
        with pytest.raises(DataError, match="image file not found") as err:
            shipped.rank(query, CAPTIONS)
        assert query in str(err.value) and 'query_kind="text"' in str(err.value)


def test_a_text_query_stays_text_and_query_kind_says_which(shipped, pictures):
    images = [pictures["jpg"], pictures["webp"]]
    by_text = shipped.rank("a dog runs", images, top_k=2)
    assert sorted(i for i, _ in by_text) == [0, 1]
    # a caption ending like a file name, read as words when the caller says so
    with pytest.warns(UnknownWordsWarning, match="dog.png"):
        assert len(shipped.rank("a dog.png", images, top_k=2, query_kind="text")) == 2
    with pytest.raises(DataError, match="none of the query's words"):
        shipped.rank(str(pictures["webp"]), images, query_kind="text")
    assert len(shipped.rank(str(pictures["webp"]), CAPTIONS, query_kind="image")) == 2
    with pytest.raises(ConfigError, match="query_kind must be one of"):
        shipped.rank("a dog", images, query_kind="caption")
    with pytest.raises(DataError, match="needs the query as a str"):
        shipped.rank(pictures["webp"], CAPTIONS, query_kind="text")


def test_an_image_query_may_be_features_or_one_embedding(shipped):
    feats = np.random.default_rng(1).standard_normal((2, 49, 1280)).astype(np.float32)
    expected = shipped.score(feats[:1], CAPTIONS)[0]
    for query in (feats[0], torch.from_numpy(feats[:1]), shipped.encode_images(feats[:1])):
        ranked = dict(shipped.rank(query, CAPTIONS, top_k=2))
        assert ranked == pytest.approx({i: float(expected[i]) for i in range(2)}, abs=1e-5)
    with pytest.raises(DataError, match="takes one image, got an embedding of 2 images"):
        shipped.rank(shipped.encode_images(feats), CAPTIONS)


# -- 2. and 3. empty and single image inputs --------------------------------------------------------------------


def test_no_images_is_a_data_error_like_no_captions():
    matcher = fresh()
    for call in (lambda: matcher.score([], CAPTIONS), lambda: matcher.rank("a dog", []),
                 lambda: matcher.encode_images(np.zeros((0, 49, 1280), dtype=np.float32)),
                 lambda: matcher.image_features([])):
        with pytest.raises(DataError, match="no images to score") as err:
            call()
        assert "pass at least one image" in str(err.value)
    with pytest.raises(DataError, match="no captions to score"):
        matcher.score(np.zeros((1, 49, 1280), dtype=np.float32), [])
    assert matcher._backbone is None


def test_one_image_alone_is_a_list_of_one(shipped, pictures):
    """A path string was iterated character by character ("cannot read image '/'")."""
    expected = shipped.score([pictures["jpg"]], CAPTIONS)
    with Image.open(pictures["jpg"]) as im:
        im.load()
        opened = im.copy()
    for single in (str(pictures["jpg"]), pictures["jpg"], pictures["jpg"].read_bytes(), opened):
        scores = shipped.score(single, CAPTIONS)
        assert scores.shape == (1, 2)
        torch.testing.assert_close(scores, expected)
    assert shipped.image_features(str(pictures["jpg"])).shape == (1, 49, 1280)
    assert dict(shipped.rank("a dog runs", str(pictures["jpg"]))).keys() == {0}


@pytest.mark.shared
def test_a_real_photo_path_alone(shipped):
    folder = SHARED / "flickr8k" / "images"
    if not folder.is_dir():
        pytest.skip(f"real Flickr8K photos not found at {folder} (../shared/data/flickr8k/images)")
    photo = next(p for p in sorted(folder.iterdir()) if p.suffix == ".jpg")
    torch.testing.assert_close(shipped.score(str(photo), CAPTIONS), shipped.score([photo], CAPTIONS))
    assert len(shipped.rank(str(photo), CAPTIONS)) == 2


# -- 4. word_attention takes one image ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def scan(tmp_path_factory) -> ImageTextMatcher:
    """An untrained SCAN t-i model of 4 regions of 32-d features of no known extractor (data.backbone empty, as a
    converted checkpoint's; attention needs no training)."""
    root = tmp_path_factory.mktemp("scan")
    data = make_precomp(root / "precomp", sizes=(("train", 40), ("dev", 8)), k=4)
    cfg = resolve_config("scan_t2i_avg", {"data": {"path": str(data)}, "model": {"embed_size": 16, "word_dim": 16}})
    _, _, vocab = prepare_data(cfg, None)
    torch.manual_seed(0)
    save_checkpoint(root / "ckpt", build_model(cfg.model), cfg, vocab)
    return ImageTextMatcher(load_checkpoint(root / "ckpt"))


@pytest.fixture(scope="module")
def scan_lite0(scan, tmp_path_factory) -> ImageTextMatcher:
    """The same untrained SCAN t-i model, of Lite0's 7 x 7 grid cells (1280-d): its data.backbone says so."""
    root = tmp_path_factory.mktemp("scan_lite0")
    cfg = copy.deepcopy(scan.checkpoint.config)
    cfg.data.backbone, cfg.model.img_dim = "lite0", 1280
    torch.manual_seed(0)
    save_checkpoint(root / "ckpt", build_model(cfg.model), cfg, scan.vocab)
    return ImageTextMatcher(load_checkpoint(root / "ckpt"))


def test_word_attention_refuses_several_images(scan_lite0):
    """An embedding of several images was read as its first image, silently."""
    scan = scan_lite0
    feats = np.random.default_rng(2).standard_normal((3, 49, 1280)).astype(np.float32)
    one = scan.word_attention(scan.encode_images(feats[:1]), "a red circle")
    assert one.tokens == ["<start>", "a", "red", "circle", "<end>"] and one.maps.shape == (5, 7, 7)
    assert scan.word_attention(feats[0], "a red circle").score == pytest.approx(one.score, abs=1e-6)
    with pytest.raises(DataError, match="word_attention takes one image, got an embedding of 3 images") as err:
        scan.word_attention(scan.encode_images(feats), "a red circle")
    assert "take(slice(i, i + 1))" in str(err.value)
    with pytest.raises(DataError, match="word_attention takes one image, got features of 3 images"):
        scan.word_attention(feats, "a red circle")
    with pytest.raises(DataError, match="takes one caption"):
        scan.word_attention(feats[0], ["a red circle"])


def test_word_attention_draws_no_map_over_regions_that_are_not_grid_cells(scan, scan_lite0):
    """A checkpoint of features of an unknown extractor (data.backbone "", e.g. `itmatch convert` of an original
    SCAN checkpoint) given 36 bottom-up boxes drew them as a 6 x 6 grid: any square count passed."""
    rng = np.random.default_rng(3)
    for k in (36, 4):
        with pytest.raises(DataError, match=f"the image's {k} regions are not grid cells") as err:
            scan.word_attention(rng.standard_normal((k, 32)).astype(np.float32), "a red circle")
        assert "no spatial map" in str(err.value) and "pass the photo itself" in err.value.hint
    # a backbone named at load says whose cells the features are (an index of photos read through it)
    named = ImageTextMatcher(scan.checkpoint, backbone="lite0")
    assert named.word_attention(rng.standard_normal((49, 32)).astype(np.float32), "a red circle").maps.shape == (
        5, 7, 7)
    with pytest.raises(DataError, match="36 regions, not the 7 x 7 grid cells of the lite0 backbone"):
        named.word_attention(rng.standard_normal((36, 32)).astype(np.float32), "a red circle")
    # an embedding of another count than the grid the model was trained on (the features check cannot see it)
    with torch.inference_mode():
        emb = scan_lite0.model.encode_images(torch.rand(1, 36, 1280))
    with pytest.raises(DataError, match="36 regions, not the 7 x 7 grid cells of the lite0 backbone"):
        scan_lite0.word_attention(emb, "a red circle")


# -- 5. precomputed features against the model ------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 49, 512), (2, 1280), (2, 3, 224, 224), (2, 81, 1280), (49, 1280)])
def test_features_of_another_shape_name_the_expected_one(shape):
    """These failed in a matrix product (RuntimeError) or with an AttributeError."""
    matcher = fresh()
    assert matcher.expected_input() == ("region features", (49, 1280))
    for array in (np.zeros(shape, dtype=np.float32), torch.rand(shape)):
        with pytest.raises(DataError, match=r"expected region features \[N, 49, 1280\]") as err:
            matcher.score(array, CAPTIONS)
        assert f"got an array of shape {list(shape)}" in str(err.value)
        assert "photos themselves" in str(err.value)
    with pytest.raises(DataError, match="must be real numbers"):
        matcher.score(np.full((2, 49, 1280), "x"), CAPTIONS)
    assert matcher._backbone is None


def test_features_of_a_model_of_unknown_extractor_check_the_channels(scan):
    assert scan.expected_input() == ("region features", (None, 32))
    assert scan.score(np.zeros((2, 9, 32), dtype=np.float32), ["a red circle"]).shape == (2, 1)  # any k
    with pytest.raises(DataError, match=r"expected region features \[N, k, 32\]; got an array of shape \[2, 4, 16\]"):
        scan.score(np.zeros((2, 4, 16), dtype=np.float32), ["a red circle"])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features_name_the_first_bad_image(bad):
    matcher = fresh()
    feats = np.zeros((4, 49, 1280), dtype=np.float32)
    feats[2, 5, 7] = feats[3, 0, 0] = bad
    with pytest.raises(DataError, match=r"non-finite \(NaN/inf\) features in image 2 \(2 bad images"):
        matcher.score(feats, CAPTIONS)
    with pytest.raises(DataError, match="in image 2"):
        matcher.rank("a dog", torch.from_numpy(feats))


# -- 6. bad arguments: itmatch errors, before any work ----------------------------------------------------------


def test_bad_arguments_are_refused_before_any_photo_is_read(pictures):
    matcher = fresh()
    photos = [pictures["jpg"], pictures["webp"]]
    for top_k in (-1, 0, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="top_k must be a whole number >= 1"):
            matcher.rank("a dog", photos, top_k=top_k)
    for batch_size in (0, -2, 2.0):
        with pytest.raises(ConfigError, match="batch_size must be a whole number >= 1"):
            matcher.image_features(photos, batch_size=batch_size)
    with pytest.raises(DataError, match="must be a caption .* got NoneType"):
        matcher.score(photos, None)
    with pytest.raises(DataError, match=r"text 0 is a int \(3\), not a string"):
        matcher.score(photos, [3])
    with pytest.raises(DataError, match="must be a caption"):
        matcher.score(photos, pictures["jpg"])  # (images and texts swapped)
    with pytest.raises(DataError, match="image 1 is a NoneType"):
        matcher.score([pictures["jpg"], None], CAPTIONS)
    with pytest.raises(DataError, match="image 0 is a ndarray"):
        matcher.score([np.zeros((49, 1280))], CAPTIONS)
    with pytest.raises(DataError, match="must be an image or a list of images, got int"):
        matcher.encode_images(3)
    with pytest.raises(DataError, match="rank's image query must be one image, got list"):
        matcher.rank([pictures["jpg"]], CAPTIONS)
    with pytest.raises(ConfigError, match="k must be a whole number >= 1"):
        matcher.rerank_scores(photos, CAPTIONS, k=0)
    assert matcher._backbone is None  # (no photo was read: the CNN was never loaded)


# -- 7. documented behaviour: score() vs rank() on unreadable captions; load(backbone=) ----------------------


def test_score_scores_every_caption_and_rank_refuses_unreadable_ones(shipped):
    feats = np.random.default_rng(3).standard_normal((1, 49, 1280)).astype(np.float32)
    scores = shipped.score(feats, ["", "qwzx vbnm", "a dog"])
    assert scores.shape == (1, 3) and torch.isfinite(scores).all()
    assert [i for i, _ in shipped.rank(feats, ["", "qwzx vbnm", "a dog"])] == [2]
    with pytest.raises(DataError, match="none of the query's words"):
        shipped.rank("qwzx vbnm", feats)
    assert "unknown_words" in ImageTextMatcher.score.__doc__ and "rank()" in ImageTextMatcher.score.__doc__
    assert "bytes" in ImageTextMatcher.encode_images.__doc__ and "numpy" in ImageTextMatcher.encode_images.__doc__
    assert ImageTextMatcher.encode_texts.__doc__ and "<unk>" in ImageTextMatcher.encode_texts.__doc__
    assert "np.ndarray" in ImageTextMatcher.score.__annotations__["images"]
    assert "data.backbone" in itmatch.load.__doc__


def test_load_refuses_a_backbone_the_model_was_not_trained_on(tmp_path):
    """lite2 (9 x 9 cells of 1280) scored photos for a model of Lite0 features without a word."""
    with pytest.raises(ConfigError, match="backbone='lite2', but the model was trained on lite0 features"):
        itmatch.load("vsepp-flickr8k", backbone="lite2")
    assert itmatch.load("vsepp-flickr8k", backbone="lite0").backbone_name == "lite0"
    with pytest.raises(ConfigError, match="unknown backbone 'lite9'"):
        itmatch.load("vsepp-flickr8k", backbone="lite9")
    # a checkpoint that records no backbone (features of another extractor): any of the model's size
    vocab = load_checkpoint(itmatch.load("vsepp-flickr8k").checkpoint.path).vocab
    cfg = resolve_config("vsepp", {"model": {"embed_size": 8, "word_dim": 8, "img_dim": 1280,
                                             "vocab_size": len(vocab)}})
    assert cfg.data.backbone == ""
    save_checkpoint(tmp_path / "ckpt", build_model(cfg.model), cfg, vocab)
    matcher = itmatch.load(tmp_path / "ckpt", backbone="lite2")
    assert (matcher.backbone_name, matcher.trained_backbone) == ("lite2", "")
    assert matcher.expected_input() == ("region features", (None, 1280))
