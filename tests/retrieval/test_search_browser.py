"""End to end in a real headless browser: uvicorn on 127.0.0.1, Debian's chromium driven by Playwright:
type a query, see ranked photos, open one, see one attention heatmap per word; a screenshot is saved.
Then a folder of hostile file names (not UTF-8, markup, `#`, `?`, `%`, newlines, 255 bytes) of 2:1 photos:
every name shown as text, every photo loaded, the explain view uncropped and unsquashed, and its URL a
deep link that opens it again. And a shipped model without word attention (VSE++): results, a note that says why
no map opens, and no error on a click."""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import HOSTILE_NAMES, serving

pytest.importorskip("fastapi", reason="the `serve` extra (fastapi, uvicorn) is not installed")
pytest.importorskip("uvicorn", reason="the `serve` extra (uvicorn) is not installed")
playwright_sync = pytest.importorskip("playwright.sync_api", reason="Playwright (dev extra) is not installed")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists() and not shutil.which("chromium"),
                       reason="no browser: /usr/bin/chromium is not installed (apt-get install -y chromium)"),
]


def _server(photos: Path, checkpoint: Path, out: Path):
    from itmatch.retrieval.index import build_index
    from itmatch.retrieval.search import Searcher
    from itmatch.retrieval.service import create_app

    build_index(photos, checkpoint, out, progress=False)
    return serving(create_app(Searcher(out)))


@pytest.fixture(scope="module")
def server(tiny_search_setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("browser") / "index"
    with _server(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], out) as base:
        yield base


@pytest.fixture(scope="module")
def hostile_server(tiny_search_setup, hostile_photos, tmp_path_factory):
    out = tmp_path_factory.mktemp("browser_names") / "index"
    with _server(hostile_photos, tiny_search_setup["checkpoint"], out) as base:
        yield base


@pytest.fixture(scope="module")
def shipped_vsepp_server(shipped_vsepp_index):
    from itmatch.retrieval.search import Searcher
    from itmatch.retrieval.service import create_app

    with serving(create_app(Searcher(shipped_vsepp_index))) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")),
                                     args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture()
def page(browser):
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    yield page
    page.close()


def _health(server: str) -> dict:
    with urllib.request.urlopen(server + "/health", timeout=30) as resp:
        return json.load(resp)


def _search(page, query: str, k: int | None = None) -> None:
    if k is not None:
        page.select_option("#k", str(k))
    page.fill("#q", query)
    page.press("#q", "Enter")
    page.wait_for_selector("#results .result img", timeout=20_000)
    # every result photo actually loaded
    page.wait_for_function("[...document.querySelectorAll('#results img')].every(i => i.complete && "
                           "i.naturalWidth > 0)", timeout=20_000)


def _assert_rank_name_score_apart(page) -> None:
    """In every card the rank, the name and the score sit side by side with a gap: none runs into another."""
    boxes = page.evaluate("""() => [...document.querySelectorAll('#results .result')].map(card => {
        const box = (sel) => card.querySelector(sel).getBoundingClientRect();
        const [c, r, i, s] = [card.querySelector('.meta').getBoundingClientRect(), box('.rank'), box('.id'),
                              box('.score')];
        return {rank: card.querySelector('.rank').textContent, left: c.left, right: c.right,
                r: [r.left, r.right], i: [i.left, i.right], s: [s.left, s.right]};
    })""")
    for b in boxes:
        assert b["left"] <= b["r"][0] and b["r"][1] + 3 <= b["i"][0], b  # rank, gap, name
        assert b["i"][1] + 3 <= b["s"][0] and b["s"][1] <= b["right"] + 0.5, b  # name, gap, score
        assert b["i"][1] > b["i"][0], b  # the name is visible, not squeezed out


def _assert_photo_and_heatmaps_show_the_same_pixels(page) -> None:
    """The explain photo and every heatmap show the whole photo at its own aspect ratio."""
    geometry = page.evaluate("""() => {
        const img = document.querySelector('#explain-photo');
        const r = img.getBoundingClientRect();
        return {natural: img.naturalWidth / img.naturalHeight, shown: r.width / r.height,
                fit: getComputedStyle(img).objectFit,
                canvases: [...document.querySelectorAll('#word-maps canvas')].map(c => {
                    const b = c.getBoundingClientRect();
                    return [c.width / c.height, b.width / b.height];
                })};
    }""")
    natural = geometry["natural"]
    assert abs(geometry["shown"] - natural) <= 0.02 * natural, geometry  # not squashed into a box
    assert geometry["fit"] in ("fill", "contain", "scale-down"), geometry  # not cropped ("cover")
    for drawn, shown in geometry["canvases"]:
        assert abs(drawn - natural) <= 0.02 * natural and abs(shown - natural) <= 0.02 * natural, geometry


def _assert_thumbnails_show_whole_photos(page) -> None:
    """Every result thumbnail shows the whole photo, letterboxed in its square cell: "cover" would crop a 2:1
    photo to its middle half, "fill" would squash it."""
    fits = page.evaluate("() => [...document.querySelectorAll('#results .result img')].map("
                         "img => getComputedStyle(img).objectFit)")
    assert fits and all(fit in ("contain", "scale-down") for fit in fits), fits


def test_query_results_and_heatmaps_in_a_real_browser(server, page, tmp_path):
    page.goto(server + "/")
    _search(page, "a large red circle in the center")
    cards = page.locator("#results .result")
    assert cards.count() == 12
    ranks = [int(t.lstrip("#")) for t in page.locator("#results .rank").all_inner_texts()]
    scores = [float(t) for t in page.locator("#results .score").all_inner_texts()]
    assert ranks == list(range(1, 13)) and scores == sorted(scores, reverse=True)
    assert not page.locator("#unknown-words").is_visible()  # every word known: no mark
    _assert_rank_name_score_apart(page)  # ranks 10 to 12 included

    cards.nth(0).click()
    page.wait_for_selector("#explain:not([hidden]) .word-map canvas", timeout=20_000)
    words = page.locator("#word-maps .word").all_inner_texts()
    assert words == ["<start>", "a", "large", "red", "circle", "in", "the", "center", "<end>"]
    # each canvas holds a drawn heatmap: the photo plus a colour overlay that varies over the grid
    spread = page.evaluate("""() => [...document.querySelectorAll('#word-maps canvas')].map(c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let lo = 255, hi = 0;
        for (let i = 0; i < d.length; i += 4 * 97) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }
        return [c.width, hi - lo];
    })""")
    assert len(spread) == len(words) and all(w == 300 and s > 30 for w, s in spread)
    _assert_photo_and_heatmaps_show_the_same_pixels(page)
    shot = tmp_path / "search_page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

    # a word the model does not know is marked on the page, beside the results it still gives
    page.fill("#q", "a large red qwzx circle")
    page.press("#q", "Enter")
    page.wait_for_selector("#unknown-words:not([hidden]) mark.unknown-word", timeout=20_000)
    assert page.locator("#unknown-words").is_visible()
    assert page.locator("#unknown-words mark.unknown-word").all_inner_texts() == ["qwzx"]
    assert "vocabulary" in page.locator("#unknown-words").inner_text()
    assert page.locator("#results .result").count() == 12
    page.screenshot(path=str(tmp_path / "unknown_words.png"))

    page.fill("#q", "qwzx")  # an error is shown on the page, not thrown
    page.press("#q", "Enter")
    page.wait_for_function("document.querySelector('#status').textContent.includes('vocabulary')")
    assert not page.locator("#unknown-words").is_visible()  # no stale mark from the previous query
    assert not page.errors, page.errors


def test_hostile_names_non_square_photos_and_a_deep_link(hostile_server, browser, page, tmp_path):
    page.goto(hostile_server + "/")
    _search(page, "a red circle", k=24)
    names = page.locator("#results .result .id").all_text_contents()
    assert sorted(names) == sorted(HOSTILE_NAMES.values())  # every name, shown as text (escaped), not markup
    assert page.evaluate("window.pwned") is None and page.locator("#results script, #results .id img").count() == 0
    _assert_rank_name_score_apart(page)  # ranks 10 to 18, and a 255-byte name among them
    _assert_thumbnails_show_whole_photos(page)  # the photos are 2:1

    page.locator("#results .result", has=page.get_by_text("caf\\xe9.png", exact=True)).click()
    page.wait_for_selector("#explain:not([hidden]) .word-map canvas", timeout=20_000)
    assert "caf\\xe9.png" in page.locator("#explain-title").inner_text()
    _assert_photo_and_heatmaps_show_the_same_pixels(page)  # the photos are 2:1
    page.screenshot(path=str(tmp_path / "hostile_names.png"), full_page=True)
    link = page.url
    assert "id=" in link

    # the link opens the same explanation in a fresh page (with the results of its query)
    other = browser.new_page(viewport={"width": 1280, "height": 1100})
    try:
        other.goto(link)
        other.wait_for_selector("#explain:not([hidden]) .word-map canvas", timeout=20_000)
        assert other.locator("#explain-title").inner_text() == page.locator("#explain-title").inner_text()
        assert other.locator("#word-maps canvas").count() == page.locator("#word-maps canvas").count()
        assert other.input_value("#q") == "a red circle"
    finally:
        other.close()

    # a link to a photo whose name holds '#', '?', '%' and '&' (each would cut or bend a naive URL)
    for name in ("what?q=1&id=x.png", "100% real %2e%2e%2Fetc.png", "hash#frag.png"):
        page.locator("#results .result", has=page.get_by_text(name, exact=True)).click()
        page.wait_for_function("(name) => document.querySelector('#explain').dataset.id === name", arg=name)
        again = browser.new_page()
        try:
            again.goto(page.url)
            again.wait_for_function("(name) => document.querySelector('#explain').dataset.id === name", arg=name,
                                    timeout=20_000)
        finally:
            again.close()
    page.click("#explain-close")
    assert "id=" not in page.url  # closing the explanation takes it out of the link
    assert not page.errors, page.errors


def test_a_model_without_attention_maps_says_so_and_its_results_open_nothing(shipped_vsepp_server, page):
    """With the shipped VSE++ model every click on a result used to end in the 409's message; the page now reads
    /health, says once why no map opens, and leaves the results unclickable; a deep link's id is dropped."""
    asked = []
    page.on("request", lambda request: asked.append(request.url))

    def late(route):  # /health answers after the deep link's search: its results must wait for it
        time.sleep(1.0)
        route.continue_()

    page.route("**/health", late)
    page.goto(shipped_vsepp_server + "/?q=a%20red%20circle&id=test_00000.png")
    page.wait_for_selector("#results .result img", timeout=20_000)
    note = page.locator("#model-note")
    assert note.is_visible() and note.inner_text() == _health(shipped_vsepp_server)["explain_note"]
    assert page.locator("#results .result.no-explain").count() == page.locator("#results .result").count() > 0
    assert page.locator("#results .result[tabindex]").count() == 0  # no keyboard stop that opens nothing
    page.locator("#results .result").nth(0).click()
    page.locator("#results .result").nth(1).focus()
    page.keyboard.press("Enter")
    page.evaluate("fetch('/health')")  # a request after the clicks: once it is seen, theirs would have been too
    page.wait_for_function("performance.getEntriesByType('resource').filter(e => e.name.endsWith('/health'))"
                           ".length >= 2")
    assert not [url for url in asked if "/api/explain" in url], asked
    assert page.locator("#explain").is_hidden() and page.locator("#status").inner_text().endswith("ms")
    assert page.evaluate("getComputedStyle(document.querySelector('#results .result')).cursor") == "default"
    assert "id=" not in page.url  # the link no longer promises a map
    assert not page.errors, page.errors


def test_a_model_with_attention_maps_shows_no_note_and_its_results_open(server, page):
    with page.expect_response(lambda response: response.url.endswith("/health")):
        page.goto(server + "/")
    _search(page, "a red circle")
    assert page.locator("#model-note").is_hidden()
    assert page.locator("#results .result.no-explain").count() == 0
    page.locator("#results .result").nth(0).click()
    page.wait_for_selector("#explain:not([hidden]) .word-map canvas", timeout=20_000)


def test_an_ensemble_ranks_by_its_mean_and_its_maps_say_whose_score_they_show(shipped_vsepp_index, tiny_search_setup,
                                                                              page, tmp_path):
    """VSE++ (no maps) with the tiny SCAN (maps) over the same photos: the page ranks by the ensemble's scores and the
    opened map names the model it is drawn from, whose score differs from the ranking's."""
    from itmatch.retrieval.index import build_index
    from itmatch.retrieval.search import Searcher
    from itmatch.retrieval.service import create_app

    scan = tmp_path / "scan"
    build_index(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], scan, progress=False)
    searcher = Searcher(shipped_vsepp_index, ensemble=[scan])
    expected = searcher.search("a red circle", k=12)
    with serving(create_app(searcher)) as base:
        page.goto(base + "/")
        _search(page, "a red circle")
        assert page.locator("#model-note").is_hidden()  # (one of its models draws maps)
        assert page.locator("#results .score").all_inner_texts() == [f"{h.score:.3f}" for h in expected]
        page.locator("#results .result").nth(0).click()
        page.wait_for_selector("#explain:not([hidden]) .word-map canvas", timeout=20_000)
        alone = Searcher(scan).explain("a red circle", expected[0].id)["score"]
        assert page.locator("#explain-title").inner_text().endswith(f"(scan_t2i_avg\u2019s score {alone:.3f})")
    assert not page.errors, page.errors


def _api_ids(server: str, query: str, k: int) -> list[str]:
    url = f"{server}/api/search?q={urllib.parse.quote(query)}&k={k}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return [hit["id"] for hit in json.load(resp)["results"]]


def test_a_late_answer_to_an_older_search_is_dropped(server, page):
    """A slow search answered after a newer one drew its results over the newer ones, under the newer query (which
    explain then asked about, with photos the query had not found)."""
    held = []

    def hold_the_first(route):  # the first search's answer comes last
        if "qwzx" in route.request.url:
            held.append(route)
        else:
            route.continue_()

    page.route("**/api/search?*", hold_the_first)
    page.goto(server + "/")
    page.fill("#q", "a large red qwzx circle")
    page.press("#q", "Enter")
    while not held:
        page.wait_for_timeout(50)
    newer = "a small blue square on the left"
    _search(page, newer)
    with page.expect_response(lambda response: "qwzx" in response.url):
        held[0].continue_()
    page.evaluate("new Promise(done => setTimeout(done, 300))")  # (time for the page to handle that answer)
    assert page.locator("#results .id").all_text_contents() == _api_ids(server, newer, 12)
    assert page.locator("#unknown-words").is_hidden()  # (the older query's unknown word is not shown)
    page.locator("#results .result").nth(0).click()
    page.wait_for_selector("#explain:not([hidden]) .word-map canvas", timeout=20_000)
    assert page.locator("#explain-title").inner_text().startswith(f"\u201c{newer}\u201d")
    assert not page.errors, page.errors


def test_a_photo_deleted_since_indexing_shows_a_note_in_its_place(tiny_search_setup, page, tmp_path):
    """A photo deleted after indexing is still ranked; its card showed a broken image."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for p in sorted(tiny_search_setup["photos"].iterdir())[:3]:
        shutil.copy(p, photos / p.name)
    with _server(photos, tiny_search_setup["checkpoint"], tmp_path / "index") as base:
        (photos / "test_00001.png").unlink()
        page.goto(base + "/")
        page.fill("#q", "a red circle")
        page.press("#q", "Enter")
        page.wait_for_selector("#results .missing-photo", timeout=20_000)
        card = page.locator("#results .result", has=page.locator(".missing-photo"))
        assert card.count() == 1 and card.locator(".id").inner_text() == "test_00001.png"
        assert "deleted or moved since it was indexed" in card.locator(".missing-photo").inner_text()
        assert page.locator("#results img").count() == 2
        assert not page.errors, page.errors
