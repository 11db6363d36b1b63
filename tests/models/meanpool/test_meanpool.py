"""The worked example of docs/architecture.md: a model added as one package (itmatch/models/meanpool) is
registered, listed by `itmatch models`, trained and evaluated by the CLI, and scored as its equations say."""

from __future__ import annotations

import json

import torch

from itmatch.cli import main
from itmatch.models.base import ImageEmb, TextEmb
from itmatch.models.registry import ARCHS, build_model, list_models, resolve_config


def test_it_is_registered_from_its_package_alone(capsys):
    assert type(ARCHS["meanpool"]).__module__ == "itmatch.models.meanpool"
    assert "meanpool" in list_models()
    assert main(["models"]) == 0
    assert any(line.split()[:2] == ["meanpool", "meanpool"] for line in capsys.readouterr().out.splitlines())
    assert resolve_config("meanpool", {"model": {"meanpool": {"dropout": 0.5}}}).model.meanpool.dropout == 0.5


def test_score_is_the_cosine_of_the_means():
    """Slow reference: mean of the real regions' embeddings and of the real words' projections, l2-normalised,
    dotted; every pair one at a time."""
    mc = resolve_config("meanpool", {"model": {"img_dim": 12, "vocab_size": 30, "embed_size": 8, "word_dim": 6}}).model
    torch.manual_seed(0)
    model = build_model(mc).eval()
    feats, mask = torch.randn(3, 5, 12), torch.rand(3, 5) > 0.3
    mask[:, 0] = True
    tokens, lengths = torch.randint(1, 30, (4, 7)), torch.tensor([7, 3, 5, 1])
    img, txt = model.encode_images(feats, mask), model.encode_texts(tokens, lengths)
    assert isinstance(img, ImageEmb) and isinstance(txt, TextEmb)
    scores = model.score(img, txt)
    fc, embed, project = model.image_encoder.fc, model.text_encoder.embed, model.text_encoder.project
    for i in range(3):
        regions = fc(feats[i][mask[i]])
        regions = regions / (regions.norm(dim=1, keepdim=True) + 1e-8)  # model.img_norm: each region l2-normalised
        v = regions.mean(0)
        v = v / (v.norm() + 1e-8)
        for j in range(4):
            t = project(embed(tokens[j, : lengths[j]])).mean(0)
            t = t / (t.norm() + 1e-8)
            torch.testing.assert_close(scores[i, j], v @ t, rtol=1e-5, atol=1e-6)


def test_trains_and_evaluates_from_the_cli(tiny_precomp, tmp_path, capsys):
    out = tmp_path / "run"
    settings = ["train.epochs=3", "train.batch_size=32", "model.embed_size=32", "model.word_dim=16",
                "train.val_images=40", "train.lr=0.002"]
    assert main(["train", "--preset", "meanpool", "--data", str(tiny_precomp), "--out", str(out), "--quiet",
                 *[arg for s in settings for arg in ("--set", s)]]) == 0
    printed = capsys.readouterr()  # --quiet: the result line alone, no bars or epoch lines
    assert printed.err == "" and printed.out.startswith("best dev rsum") and printed.out.count("\n") == 1
    metrics = tmp_path / "metrics.json"
    assert main(["evaluate", str(out / "best"), "--split", "test", "--json", str(metrics)]) == 0
    result = json.loads(metrics.read_text())
    assert result["rsum"] > 120  # chance on 40 images and 200 captions: rsum about 30
