"""The HTTP API driven by its own OpenAPI schema (schemathesis, in process over ASGI): thousands of generated
requests, inside and outside the schema, and hand-written probes of wrong types and absurd sizes. Every one
is answered without a server error, and every error is the JSON envelope {"error": {status, message, hint}}.

ITMATCH_API_FUZZ_REQUESTS sets the number of generated requests (default 5000; docs/reliability.md)."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
schemathesis = pytest.importorskip("schemathesis", reason="schema-driven API tests need schemathesis (dev extra)")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import negative_data_rejection  # noqa: E402

from itmatch.retrieval.index import build_index  # noqa: E402
from itmatch.retrieval.search import MAX_K, Searcher, read_captions_file  # noqa: E402
from itmatch.retrieval.service import LOCAL_HOSTS, MAX_JSON_BYTES, SafeJSONResponse, create_app  # noqa: E402

REQUESTS = int(os.environ.get("ITMATCH_API_FUZZ_REQUESTS", "5000"))
UPLOAD_LIMIT = 200_000


@pytest.fixture(scope="module")
def app(tiny_search_setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("api-fuzz") / "index"
    build_index(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], out, progress=False)
    searcher = Searcher(out, captions=read_captions_file(tiny_search_setup["captions"]))
    # (TestClient and schemathesis' ASGI calls send the host name "testserver")
    return create_app(searcher, max_upload_bytes=UPLOAD_LIMIT, allowed_hosts=[*LOCAL_HOSTS, "testserver"])


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, raise_server_exceptions=False)


def _assert_error_envelope(status: int, body: bytes) -> None:
    error = json.loads(body)["error"]
    assert error["status"] == status and isinstance(error["message"], str) and error["message"]
    assert error["hint"] is None or isinstance(error["hint"], str)


def test_schema_declares_the_bodies_and_ranges_the_handlers_enforce(client):
    """What the schema-driven campaign below generates from: without these declarations it would never send
    a JSON body or an upload, nor a k outside 1..MAX_K."""
    spec = client.get("/api/openapi.json").json()["paths"]
    body = spec["/api/search"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["q"] and body["properties"]["k"] == {
        "type": "integer", "minimum": 1, "maximum": MAX_K, "default": 10, "description": "results"}
    assert spec["/api/search/image"]["post"]["requestBody"]["content"]["application/octet-stream"]["schema"] == {
        "type": "string", "format": "binary"}
    for path, method in (("/api/search", "get"), ("/api/search/image", "post")):
        k = next(p for p in spec[path][method]["parameters"] if p["name"] == "k")["schema"]
        assert (k["minimum"], k["maximum"]) == (1, MAX_K)


# Requests that answered 500 before the hardening (first four), and their neighbours.
PROBES = [
    ("lone surrogate in q", b'{"q": "red \\ud800", "k": 3}', 422),
    ("k of 5000 digits", b'{"q": "red", "k": 1' + b"0" * 5000 + b"}", 400),
    ("JSON nested 30,000 deep", b"[" * 30_000 + b"]" * 30_000, 400),
    ("k a boolean", b'{"q": "red", "k": true}', 422),
    ("k infinite", b'{"q": "red", "k": 1e400}', 422),
    ("k NaN", b'{"q": "red", "k": NaN}', 422),
    ("k a string", b'{"q": "red", "k": "3"}', 422),
    ("k out of range", b'{"q": "red", "k": 100000000000000000000000000}', 422),
    ("q a number", b'{"q": 5}', 422),
    ("q missing", b'{"k": 3}', 422),
    ("body a list", b'["red"]', 422),
    ("body a string", b'"red"', 422),
    ("not UTF-8", b'{"q": "r\xffd"}', 400),
    ("empty body", b"", 400),
    ("body over the limit", b'{"q": "red", "k": 3}' + b" " * MAX_JSON_BYTES, 413),
]


@pytest.mark.parametrize(("what", "body", "status"), PROBES, ids=[p[0] for p in PROBES])
def test_wrong_types_and_absurd_sizes_are_4xx_json_errors(client, what, body, status):
    resp = client.post("/api/search", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    _assert_error_envelope(status, resp.content)


@pytest.mark.parametrize(("url", "status"), [
    ("/api/search?q=red&k=" + "1" * 5000, 422),
    ("/api/search?q=red&k=true", 422),
    ("/api/search?q=red&k=0", 422),
    (f"/api/search?q=red&k={MAX_K + 1}", 422),
    ("/api/search?q=red%ed%a0%80&k=3", 422),  # a UTF-8-encoded surrogate
    ("/api/explain?q=red&id=test%ff", 404),
    ("/api/images/test%00", 404),
    ("/api/images/" + "a/" * 3000, 404),
])
def test_absurd_query_strings_and_paths_are_4xx_json_errors(client, url, status):
    resp = client.get(url)
    assert resp.status_code == status, resp.text
    _assert_error_envelope(status, resp.content)


def test_upload_declared_larger_than_the_limit_is_refused_unread(client):
    resp = client.post("/api/search/image", content=b"x", headers={"content-length": str(10**30)})
    assert resp.status_code == 413, resp.text


def test_a_string_utf8_cannot_hold_is_escaped_not_a_server_error():
    body = SafeJSONResponse({"id": "photo-\udcff.jpg"}).body  # a file name with an undecodable byte
    assert json.loads(body) == {"id": "photo-\udcff.jpg"}


# Well-formed JSON of every type and size for POST /api/search, beyond what a schema-driven generator sends:
# booleans where integers belong, integers past 64 bits, strings with lone surrogates, deep nesting, raw bytes.
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)  # a separate branch: rare otherwise
text = st.text(max_size=12) | st.tuples(st.text(max_size=4), surrogates).map("".join)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
queries = st.sampled_from(["red", "a red circle"]) | st.sampled_from(["red ", "a "]).flatmap(
    lambda words: text.map(lambda tail: words + tail)) | json_values  # known words, with odd text after them
k_values = (st.booleans() | st.integers(-3, MAX_K + 3) | st.integers(min_value=2**63) | st.floats() | text
            | json_values)
objects = st.fixed_dictionaries({"q": queries, "k": k_values}) | st.fixed_dictionaries({"q": queries})
search_bodies = st.one_of(  # json.dumps writes lone surrogates as \udXXX escapes, floats as NaN/Infinity
    *[objects.map(lambda doc: json.dumps(doc).encode())] * 3, json_values.map(lambda doc: json.dumps(doc).encode()),
    st.integers(1, 40_000).map(lambda depth: b"[" * depth + b"]" * depth), st.binary(max_size=64))
BODY_EXAMPLES = int(os.environ.get("ITMATCH_API_FUZZ_BODIES", "300"))


def test_arbitrary_json_bodies_never_get_a_server_error(client):
    @settings(max_examples=BODY_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=search_bodies)
    def run(body):
        resp = client.post("/api/search", content=body, headers={"content-type": "application/json"})
        assert resp.status_code in (200, 400, 413, 422), (body[:200], resp.status_code, resp.text[:300])
        if resp.status_code != 200:
            _assert_error_envelope(resp.status_code, resp.content)

    run()


@pytest.mark.slow
def test_generated_requests_never_get_a_server_error(app):
    """REQUESTS requests drawn from the schema of every operation, half fitting it (positive) and half not
    (negative: wrong types, missing fields, out-of-range values): no 5xx, every request the schema forbids
    refused with a 4xx (schemathesis' negative_data_rejection), errors in the envelope."""
    schema = schemathesis.openapi.from_asgi("/api/openapi.json", app)
    requests = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    answered: collections.Counter[tuple[str, str, int]] = collections.Counter()

    @settings(max_examples=REQUESTS, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=requests)
    def run(case):
        resp = case.call()
        answered[(case.method, case.path, resp.status_code)] += 1
        case.validate_response(resp, checks=[not_a_server_error, negative_data_rejection])
        if resp.status_code >= 400:
            _assert_error_envelope(resp.status_code, resp.content)

    cpu = time.process_time()
    run()
    # the figures docs/reliability.md quotes (shown with pytest -s)
    print(f"\n{sum(answered.values())} generated requests in {time.process_time() - cpu:.0f} s of CPU, "
          "by operation and status:")
    for (method, path, status), n in sorted(answered.items()):
        print(f"  {method:<5} {path:<28} {status}  {n}")
    assert sum(answered.values()) >= REQUESTS
