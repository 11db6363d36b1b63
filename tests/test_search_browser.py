"""End to end in a real headless browser: uvicorn on 127.0.0.1, Debian's chromium driven by Playwright:
type a query, see ranked photos, open one, see one attention heatmap per word; a screenshot is saved."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the `serve` extra (fastapi, uvicorn) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the `serve` extra (uvicorn) is not installed")
playwright_sync = pytest.importorskip("playwright.sync_api", reason="Playwright (dev extra) is not installed")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists() and not shutil.which("chromium"),
                       reason="no browser: /usr/bin/chromium is not installed (apt-get install -y chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_search_setup, tmp_path_factory):
    from itmatch.retrieval.index import build_index
    from itmatch.retrieval.search import Searcher
    from itmatch.retrieval.service import create_app

    out = tmp_path_factory.mktemp("browser") / "index"
    build_index(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], out, progress=False)
    port = _free_port()
    config = uvicorn.Config(create_app(Searcher(out)), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def test_query_results_and_heatmaps_in_a_real_browser(server, tmp_path):
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")),
                                    args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server + "/")
            page.fill("#q", "a large red circle in the center")
            page.press("#q", "Enter")
            page.wait_for_selector("#results .result img", timeout=20_000)
            cards = page.locator("#results .result")
            assert cards.count() == 12
            ranks = [int(t.lstrip("#")) for t in page.locator("#results .rank").all_inner_texts()]
            scores = [float(t) for t in page.locator("#results .score").all_inner_texts()]
            assert ranks == list(range(1, 13)) and scores == sorted(scores, reverse=True)
            assert not page.locator("#unknown-words").is_visible()  # every word known: no mark
            # every result photo actually loaded
            page.wait_for_function("[...document.querySelectorAll('#results img')].every(i => i.complete && "
                                   "i.naturalWidth > 0)", timeout=20_000)

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
            print(f"screenshot: {tmp_path / 'unknown_words.png'}")

            page.fill("#q", "qwzx")  # an error is shown on the page, not thrown
            page.press("#q", "Enter")
            page.wait_for_function("document.querySelector('#status').textContent.includes('vocabulary')")
            assert not page.locator("#unknown-words").is_visible()  # no stale mark from the previous query
            assert not errors, errors
        finally:
            browser.close()
