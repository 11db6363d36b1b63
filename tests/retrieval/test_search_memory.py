"""What a Searcher keeps of its photos and captions: a model whose score is one product of item vectors (VSE++, MMCA
alpha = 0, SMAN-IM; a pair-independent head) keeps the vectors alone, no region or word embeddings it never reads,
and ranks as it does with them (docs/search.md, "What a search keeps in memory")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from itmatch.retrieval.search import Searcher, read_captions_file

QUERY = "a red circle in the center"


def test_a_pair_independent_model_keeps_the_vectors_alone_and_ranks_as_with_everything(shipped_vsepp_index,
                                                                                       tiny_search_setup):
    captions = read_captions_file(tiny_search_setup["captions"])
    searcher = Searcher(shipped_vsepp_index, captions=captions)
    (member,) = searcher.members
    matcher = member.matcher
    assert member.images.regions.numel() == 0 and member.images.extras == {}
    assert member.images.vector.shape == (len(searcher.ids), 1024)
    with torch.inference_mode():
        features = torch.from_numpy(np.array(member.index.features()))
        full = matcher.model.head.prepare_images(matcher.model.encode_image_fields(features))
        expected = matcher.score(full, [QUERY])[:, 0]
    got = {hit.id: hit.score for hit in searcher.search(QUERY, k=len(searcher.ids))}
    assert got == pytest.approx(dict(zip(searcher.ids, expected.tolist(), strict=True)), abs=1e-6)

    photo = tiny_search_setup["photos"] / searcher.ids[0]
    hits = searcher.search_image(photo, k=5)
    assert searcher._caption_embs[0].words.numel() == 0  # (encoded at the first photo query, kept as scored)
    with torch.inference_mode():
        scores = matcher.score([photo], captions)[0]
    best = torch.topk(scores, 5).values.tolist()
    assert [h["score"] for h in hits] == pytest.approx(best, abs=1e-5)
