"""The HTTP service through the real app (FastAPI TestClient over create_app, a real index and model)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

fastapi = pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")

from fastapi.testclient import TestClient  # noqa: E402

from itmatch.retrieval.index import build_index  # noqa: E402
from itmatch.retrieval.search import MAX_QUERY_CHARS, Searcher, read_captions_file  # noqa: E402
from itmatch.retrieval.service import create_app  # noqa: E402

LOCAL = "http://localhost"  # (the server answers only to this machine's names: TestClient's own is "testserver")


@pytest.fixture(scope="module")
def searcher(tiny_search_setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "index"
    build_index(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], out, progress=False)
    return Searcher(out, captions=read_captions_file(tiny_search_setup["captions"]))


@pytest.fixture(scope="module")
def client(searcher):
    return TestClient(create_app(searcher, max_upload_bytes=200_000), base_url=LOCAL)


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"]["status"] == status and body["error"]["message"]
    return body["error"]


def test_search_ranked_and_images_served(client, tiny_search_setup):
    resp = client.get("/api/search", params={"q": "a small blue square on the left", "k": 5})
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert [r["rank"] for r in results] == [1, 2, 3, 4, 5]
    assert all(a["score"] >= b["score"] for a, b in zip(results, results[1:], strict=False))
    img = client.get(results[0]["url"])
    assert img.status_code == 200 and img.headers["content-type"] == "image/png"
    assert img.content == (tiny_search_setup["photos"] / results[0]["id"]).read_bytes()
    post = client.post("/api/search", json={"q": "a small blue square on the left", "k": 5})
    assert [r["id"] for r in post.json()["results"]] == [r["id"] for r in results]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["images"] == 12 and health["model"]["arch"] == "scan"
    assert health["explain"] is True and health["explain_note"] is None  # SCAN attends from words to regions


def test_explain_shapes_and_normalisation(client, searcher):
    image_id = searcher.ids[3]
    resp = client.get("/api/explain", params={"q": "A red circle above two stars", "id": image_id})
    assert resp.status_code == 200
    data = resp.json()
    assert data["grid"] == [7, 7] and data["normalised_over"] == "regions"
    assert [w["word"] for w in data["words"]] == ["<start>", "a", "red", "circle", "above", "two", "stars", "<end>"]
    for w in data["words"]:
        grid = w["weights"]
        assert len(grid) == 7 and all(len(row) == 7 for row in grid)
        flat = [x for row in grid for x in row]
        assert min(flat) >= 0 and abs(sum(flat) - 1.0) <= 1e-5  # alpha' is a softmax over the 49 regions
    # the explained pair's score is the score the search ranks by
    hit = {h.id: h.score for h in searcher.search("A red circle above two stars", k=12)}
    assert abs(hit[image_id] - data["score"]) <= 1e-5
    unknown = client.get("/api/explain", params={"q": "a red qwzx", "id": image_id}).json()
    assert [w["known"] for w in unknown["words"]] == [True, True, True, False, True]


def test_every_search_answers_with_the_words_it_could_not_read(client, searcher, tiny_search_setup):
    resp = client.get("/api/search", params={"q": "a red qwzx circle", "k": 3})
    assert resp.status_code == 200 and resp.json()["unknown_words"] == ["qwzx"]
    assert client.post("/api/search", json={"q": "a red qwzx circle", "k": 3}).json()["unknown_words"] == ["qwzx"]
    assert client.get("/api/search", params={"q": "a red circle"}).json()["unknown_words"] == []
    error = _error(client.get("/api/search", params={"q": "qwzx plokm"}), 422)
    assert "qwzx, plokm" in error["message"]  # the refusal names the words
    assert client.get("/api/explain", params={"q": "a red qwzx", "id": searcher.ids[0]}).json()["unknown_words"] == [
        "qwzx"]
    # photo -> captions: a caption without a known word is never ranked, and is counted
    collection = Searcher(searcher.index.root, captions=["zzz qqq xxx", "a red qwzx circle", "a blue square"])
    photo = (tiny_search_setup["photos"] / "test_00005.png").read_bytes()
    data = TestClient(create_app(collection), base_url=LOCAL).post("/api/search/image", params={"k": 3},
                                                                   content=photo).json()
    assert data["captions_without_known_word"] == 1
    assert {r["caption"]: r["unknown_words"] for r in data["results"]} == {"a red qwzx circle": ["qwzx"],
                                                                          "a blue square": []}


def test_image_to_text(client, tiny_search_setup):
    photo = (tiny_search_setup["photos"] / "test_00005.png").read_bytes()
    resp = client.post("/api/search/image", params={"k": 3}, content=photo, headers={"content-type": "image/png"})
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert len(results) == 3 and results[0]["score"] >= results[2]["score"]


def _png(size, colour=0) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("method", "url", "kwargs", "status"), [
    ("get", "/api/search", {"params": {"q": ""}}, 422),
    ("get", "/api/search", {"params": {"q": "   "}}, 422),
    ("get", "/api/search", {"params": {"q": "red " * (MAX_QUERY_CHARS // 4 + 1)}}, 422),
    ("get", "/api/search", {"params": {"q": "qwzx plokm"}}, 422),
    ("get", "/api/search?q=a%20red%20%FF%FE", {}, 422),  # not UTF-8 (was "none of the query's words is known")
    ("get", "/api/search", {"params": {"q": "red", "k": "many"}}, 422),
    ("get", "/api/search", {"params": {"q": "red", "k": 100000}}, 422),
    ("post", "/api/search", {"content": b'{"q": "red", '}, 400),
    ("post", "/api/search", {"content": b'["red"]'}, 422),
    ("post", "/api/search/image", {"content": b"GIF89a but not really"}, 415),
    ("post", "/api/search/image", {"content": b"%PDF-1.4 hello"}, 415),
    ("post", "/api/search/image", {"content": b""}, 400),
    ("post", "/api/search/image", {"content": b"\x00" * 300_000}, 413),  # over this app's 200 kB limit
    ("post", "/api/search/image", {"content": _png((9000, 9000))}, 413),  # 81 Mpx in ~80 kB: a bomb
    ("get", "/api/images/not-indexed.png", {}, 404),
    ("get", "/api/images/..%2F..%2F..%2Fetc%2Fpasswd", {}, 400),
    ("get", "/api/images/%2Fetc%2Fpasswd", {}, 400),
    ("get", "/api/images/sub%2F..%2Ftest_00000.png", {}, 400),
    ("get", "/api/images/C:%5CWindows%5Cwin.ini", {}, 400),
    ("get", "/api/explain", {"params": {"q": "red", "id": "nope.png"}}, 404),
    ("get", "/api/explain", {"params": {"q": "red"}}, 400),  # (no id: "no image id given")
    ("get", "/api/explain", {"params": {"q": "", "id": "test_00000.png"}}, 422),
    ("get", "/api/nothing-here", {}, 404),
])
def test_bad_input_is_a_4xx_json_error_and_the_server_keeps_serving(client, caplog, method, url, kwargs, status):
    with caplog.at_level("WARNING", logger="itmatch.retrieval.service"):
        _error(getattr(client, method)(url, **kwargs), status)
    assert any(str(status) in r.getMessage() for r in caplog.records)  # logged
    assert client.get("/api/search", params={"q": "a red circle", "k": 1}).status_code == 200


def test_the_apis_k_limit_is_said_as_the_apis(client):
    """POST left the range check to the Searcher, whose hint names Python's way around the limit."""
    error = _error(client.post("/api/search", json={"q": "red", "k": 101}), 422)
    assert error["message"] == "k must be between 1 and 100, got 101" and "Python" not in (error.get("hint") or "")


def test_a_query_of_bytes_that_are_not_utf8_is_told_so(client):
    error = _error(client.get("/api/search?q=a%20red%20%FF%FE"), 422)
    assert error["message"] == "the query holds bytes that are not UTF-8 text"


def test_bomb_under_the_byte_limit_is_refused_before_decoding(searcher):
    big = TestClient(create_app(searcher), base_url=LOCAL)  # default 10 MB upload limit
    _error(big.post("/api/search/image", content=_png((12000, 12000))), 413)


def test_an_upload_that_is_not_an_image_is_named_plainly(client):
    """(PIL's own message names the in-memory file object, "<_io.BytesIO object at 0x7f...>": not for a user)"""
    error = _error(client.post("/api/search/image", content=b"%PDF-1.4 hello"), 415)
    assert error["message"] == "not a readable image (cannot identify image file)"


def test_a_photo_answers_head_as_get_without_the_body(client):
    got, head = client.get("/api/images/test_00000.png"), client.head("/api/images/test_00000.png")
    assert got.status_code == head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content))
    assert client.head("/api/images/nope.png").status_code == 404


def test_metrics_count_requests_and_latency(searcher):
    c = TestClient(create_app(searcher), base_url=LOCAL)
    for _ in range(3):
        c.get("/api/search", params={"q": "a red circle"})
    c.get("/api/search", params={"q": ""})
    m = c.get("/metrics").json()
    route = m["routes"]["GET /api/search"]
    assert route["requests"] == 4 and route["by_status"] == {"200": 3, "422": 1}
    assert 0 < route["latency_ms"]["p50"] <= route["latency_ms"]["p99"]


def test_web_page_and_static_files_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="search-form"' in page.text and "/static/app.js" in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "css")):
        resp = client.get(f"/static/{name}")
        assert resp.status_code == 200 and kind in resp.headers["content-type"]


def test_a_port_in_use_is_said_before_the_model_loads(tiny_search_setup, tmp_path, monkeypatch):
    """`itmatch serve` binds its port first (then serves on that very socket): a busy port is a one-line error at
    once, not uvicorn's log line after the model has loaded."""
    import socket

    from itmatch.errors import ConfigError
    from itmatch.retrieval import service

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(service, "Searcher", loads)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{busy.getsockname()[1]}: Address already"):
            service.serve(tmp_path, port=busy.getsockname()[1])


def test_a_photo_over_the_limits_is_refused_with_how_to_send_it(client):
    """A 413 said only what was too large; a photo straight from a camera is over 10 MB or 40 Mpx."""
    for body in (b"\x00" * 300_000, _png((9000, 9000))):  # over this app's 200 kB; 81 Mpx in ~80 kB
        assert "resize the photo" in _error(client.post("/api/search/image", content=body), 413)["hint"]
    too_long = b'{"q": "red", "k": 3}' + b" " * (64 * 1024)
    assert "at most 300 characters" in _error(client.post("/api/search", content=too_long), 413)["hint"]


def test_no_id_is_answered_with_the_way_of_the_route_it_came_to(client):
    """GET /api/images/ (no id) was told to "pass id=", the parameter of /api/explain only."""
    assert _error(client.get("/api/images/"), 400)["hint"] == "give an image id as returned by the search"
    assert _error(client.get("/api/explain", params={"q": "red"}), 400)["hint"].startswith("pass id=")


def test_only_this_machines_names_and_the_allowed_ones_are_answered(searcher, caplog):
    """DNS rebinding: a web page of evil.example, once its name resolves to 127.0.0.1, reached the server as
    `Host: evil.example` and read every answer (searches, photos) from the visitor's browser. Such a request is
    refused (400) and logged with the way to allow a name that is the server's own."""
    app = create_app(searcher)
    for name in ("localhost", "127.0.0.1", "[::1]"):
        assert TestClient(app, base_url=f"http://{name}:8000").get("/health").status_code == 200
    evil = TestClient(app, base_url="http://evil.example:8000")
    with caplog.at_level("WARNING", logger="itmatch.retrieval.service"):
        for url in ("/api/search?q=red", "/api/images/test_00000.png", "/", "/metrics"):
            assert evil.get(url).status_code == 400
    assert "refused the host name 'evil.example:8000'" in caplog.text and "--allowed-host NAME" in caplog.text
    assert TestClient(app).get("/health").status_code == 400  # (TestClient's own name, "testserver")
    lan = create_app(searcher, allowed_hosts=["photos.lan", "::1"])
    assert TestClient(lan, base_url="http://photos.lan:8000").get("/health").status_code == 200
    assert TestClient(lan, base_url="http://[::1]:8000").get("/health").status_code == 200
    assert TestClient(lan, base_url="http://localhost").get("/health").status_code == 400  # only the names given
    assert TestClient(create_app(searcher, allowed_hosts=["*"]), base_url="http://evil.example").get(
        "/health").status_code == 200


@pytest.mark.parametrize(("host", "allowed", "answered"), [
    ("127.0.0.1", [], ["localhost", "127.0.0.1", "[::1]"]),
    ("::1", [], ["localhost", "127.0.0.1", "[::1]"]),
    ("192.168.1.5", [], ["localhost", "127.0.0.1", "[::1]", "192.168.1.5"]),
    ("fe80::1", [], ["localhost", "127.0.0.1", "[::1]", "[fe80::1]"]),
    ("192.168.1.5", ["Photos.LAN", "*.home.arpa"], ["localhost", "127.0.0.1", "[::1]", "192.168.1.5", "photos.lan",
                                                    "*.home.arpa"]),
    ("0.0.0.0", [], ["*"]),  # every interface: the names the network knows the machine by are not known here
    ("::", [], ["*"]),
    ("0:0:0:0:0:0:0:0", [], ["*"]),  # (every interface written another way: it answered this machine's names only)
    ("0", [], ["*"]),
    ("0.0.0.0", ["photos.lan"], ["localhost", "127.0.0.1", "[::1]", "photos.lan"]),
    ("127.0.0.1", ["*"], ["*"]),
])
def test_the_host_names_answered_follow_host_and_allowed_host(host, allowed, answered):
    from itmatch.retrieval.service import trusted_hosts

    assert trusted_hosts(host, allowed) == answered


def test_serve_answers_the_names_of_its_host_and_says_it_has_no_authentication(searcher, monkeypatch, caplog):
    import uvicorn

    from itmatch.errors import ConfigError
    from itmatch.retrieval.service import serve

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(self.config.app))
    with caplog.at_level("INFO", logger="itmatch.retrieval.service"):
        serve(searcher.index.root, host="0.0.0.0", port=0, allowed_hosts=["photos.lan"])
    assert "no authentication: anyone who can reach this machine" in caplog.text
    assert "answering requests for the host names localhost, 127.0.0.1, [::1], photos.lan" in caplog.text
    assert TestClient(served[-1], base_url="http://photos.lan").get("/health").status_code == 200
    assert TestClient(served[-1], base_url="http://evil.example").get("/health").status_code == 400
    caplog.clear()
    with caplog.at_level("INFO", logger="itmatch.retrieval.service"):
        serve(searcher.index.root, host="127.0.0.1", port=0)
    assert "no authentication" not in caplog.text  # (this machine only)
    with pytest.raises(ConfigError, match="allowed host 'photos.lan:8000' is not a host name"):
        serve(searcher.index.root, port=0, allowed_hosts=["photos.lan:8000"])


def test_an_address_of_another_machine_is_told_to_take_one_of_this_one(searcher, monkeypatch, caplog):
    """`itmatch serve --host 8.8.8.8` was told to "pass another --port"; and an IPv6 URL was printed unbracketed."""
    import uvicorn

    from itmatch.errors import ConfigError
    from itmatch.retrieval import service

    with pytest.raises(ConfigError, match=r"cannot listen on 192\.0\.2\.1:8000: Cannot assign") as refused:
        service.listen("192.0.2.1", 8000)  # (TEST-NET-1: never an address of this machine)
    assert "--host 127.0.0.1" in refused.value.hint and "--host 0.0.0.0" in refused.value.hint
    try:
        service.listen("::1", 0).close()
    except (OSError, ConfigError):
        pytest.skip("no IPv6 loopback here")
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: sockets[0].close())
    with caplog.at_level("INFO", logger="itmatch.retrieval.service"):
        service.serve(searcher.index.root, host="::1", port=0)
    port = int(caplog.text.split("on http://[::1]:")[1].split("/")[0])
    assert port > 0  # (the port the system chose for --port 0, not 0)
    assert "no authentication" not in caplog.text  # (::1 is this machine only)


@pytest.mark.parametrize("route", ["text", "photo"])
def test_model_work_leaves_the_server_free_to_answer_other_requests(searcher, route):
    """POST /api/search and /api/search/image ran decoding, the CNN and scoring on the event loop: while one ran,
    /health and every photo file waited for it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from conftest import serving

    started, release = threading.Event(), threading.Event()

    def busy(*args, **kwargs):  # the model's work, held until /health has answered
        started.set()
        release.wait(30)
        return []

    name = "search" if route == "text" else "search_image"
    setattr(searcher, name, busy)
    try:
        with serving(create_app(searcher)) as base, ThreadPoolExecutor(1) as pool:
            post = (lambda: httpx.post(base + "/api/search", json={"q": "red"}, timeout=60)) if route == "text" else (
                lambda: httpx.post(base + "/api/search/image", content=_png((32, 32)), timeout=60))
            answer = pool.submit(post)
            assert started.wait(30)
            try:
                assert httpx.get(base + "/health", timeout=5).status_code == 200  # (timed out while it worked)
            finally:
                release.set()
            assert answer.result().status_code == 200
    finally:
        release.set()
        delattr(searcher, name)
