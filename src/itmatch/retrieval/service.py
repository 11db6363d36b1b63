"""HTTP service over an index (FastAPI): search API, photo files, attention maps, health, metrics, web page.

    GET|POST /api/search (text -> photos), POST /api/search/image (photo -> captions), GET /api/images/{id},
    GET /api/explain (per-word attention), GET /health, GET /metrics, GET / (the page: itmatch/retrieval/web/)

Every bad input is a 4xx with a JSON body {"error": {"status", "message", "hint"}}, and the process keeps
serving. Routes, answers and errors: docs/search.md, 'HTTP API'. There is no authentication; requests are answered
only under the host names of `trusted_hosts` (TrustedHostMiddleware), so that a web page of another site cannot
read the photos by pointing a name of its own at this machine (DNS rebinding): docs/search.md, 'Who can reach it'.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from itmatch.argtypes import HOST_FORMS, allowed_host
from itmatch.errors import ConfigError
from itmatch.retrieval.limits import MAX_K, MAX_QUERY_CHARS, MAX_UPLOAD_BYTES
from itmatch.retrieval.search import (
    RESIZE,
    QueryError,
    Searcher,
    check_k,
    open_upload,
    read_captions_file,
)

log = logging.getLogger("itmatch.retrieval.service")
WEB_DIR = Path(__file__).parent / "web"
LATENCY_WINDOW = 2048  # latencies kept per route for the percentiles
MAX_JSON_BYTES = 64 * 1024  # a POST /api/search body: a 300-character query, even all \uXXXX escapes, is < 2 kB
JSON_HINT = f'a query is at most {MAX_QUERY_CHARS} characters: send {{"q": "a dog jumping", "k": 10}}'
#: the names a browser on this machine reaches the server by: answered whatever --host is
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: --host values that listen on every interface of the machine
ALL_INTERFACES = ("0.0.0.0", "::", "", "0")


class Metrics:
    """Request counts per (route, status) and latency percentiles over a sliding window per route."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.latency: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=LATENCY_WINDOW))
        self.total_seconds: dict[str, float] = defaultdict(float)

    def record(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.counts[route][status] += 1
            self.latency[route].append(seconds)
            self.total_seconds[route] += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            routes = {}
            for route, by_status in self.counts.items():
                lat = sorted(self.latency[route])
                n = sum(by_status.values())

                def pct(p: float, lat: list[float] = lat) -> float:
                    return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 3) if lat else 0.0

                routes[route] = {"requests": n, "by_status": {str(s): c for s, c in sorted(by_status.items())},
                                 "latency_ms": {"mean": round(1000 * self.total_seconds[route] / n, 3),
                                                "p50": pct(0.50), "p99": pct(0.99), "max": pct(1.0),
                                                "window": len(lat)}}
            return {"uptime_s": round(time.time() - self.started, 1),
                    "requests": sum(r["requests"] for r in routes.values()), "routes": routes}


# Request bodies the handlers read themselves (to answer malformed ones with their own messages), declared
# in the OpenAPI schema so that clients, /api/docs and the schema-driven tests (tests/retrieval/test_api_fuzz.py)
# see them.
SEARCH_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["q"],
    "properties": {"q": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS, "description": "text query"},
                   "k": {"type": "integer", "minimum": 1, "maximum": MAX_K, "default": 10,
                         "description": "results"}}}}}}
IMAGE_BODY = {"required": True, "description": "the photo's bytes (JPEG, PNG, GIF, BMP, WebP or TIFF)",
              "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                          "image/*": {"schema": {"type": "string", "format": "binary"}}}}


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: a string no UTF-8 can hold (a lone surrogate, e.g. a file name's
    undecodable bytes) is written as a \\uXXXX escape instead of failing the response with a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


async def read_body(request: Request, limit: int, hint: str | None = None) -> bytes:
    """The request body, refused with 413 (and `hint`, how to send less) as soon as it exceeds `limit` bytes
    (declared or streamed), so an absurd body is never held in memory whole."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise QueryError(f"request body of {declared} bytes exceeds the limit of {limit}", status=413, hint=hint)
    data = bytearray()
    async for part in request.stream():  # bounded even when the length is not declared
        data += part
        if len(data) > limit:
            raise QueryError(f"request body exceeds the limit of {limit} bytes", status=413, hint=hint)
    return bytes(data)


def parse_search_body(body: bytes) -> tuple[str, int]:
    """(q, k) of a POST /api/search body, or QueryError: 400 for what is not JSON, 422 for JSON of the
    wrong shape (k a boolean, q with a lone surrogate that no response could encode)."""
    example = 'send {"q": "a dog jumping", "k": 10}'
    try:
        data = json.loads(body)
    except RecursionError:  # json's C scanner refuses deep nesting this way
        raise QueryError("malformed JSON body (nested too deeply)", status=400, hint=example) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QueryError(f"malformed JSON body ({exc})", status=400, hint=example) from None
    except ValueError:  # Python refuses to convert an integer literal this long (sys.get_int_max_str_digits)
        raise QueryError(f"malformed JSON body (a number of more than {sys.get_int_max_str_digits()} digits)",
                         status=400, hint=example) from None
    shape = 'the body must be a JSON object {"q": string, "k": integer}'
    if not isinstance(data, dict) or not isinstance(data.get("q"), str):
        raise QueryError(shape, hint=example)
    k = data.get("k", 10)
    if not isinstance(k, int) or isinstance(k, bool):
        raise QueryError(f"{shape}; k is {type(k).__name__} {json.dumps(k)[:40]}", hint=example)
    check_k(k)  # (the API's limit, said as the API's: the Searcher's own check names Python's way around it)
    try:
        data["q"].encode("utf-8")
    except UnicodeEncodeError:
        raise QueryError("q is not valid Unicode text (it holds a lone surrogate escape such as \\ud800)",
                         hint=example) from None
    return data["q"], k


def _error(status: int, message: str, hint: str | None = None) -> JSONResponse:
    return SafeJSONResponse({"error": {"status": status, "message": message, "hint": hint}}, status_code=status)


def image_url(image_id: str) -> str:
    """The photo's URL: the id percent-encoded (`#`, `?`, `%`, spaces), sub-folders kept as path segments."""
    return "/api/images/" + quote(image_id)


def url_host(host: str) -> str:
    """An address as a URL and a Host header write it: an IPv6 address in brackets (http://[::1]:8000/)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def trusted_hosts(host: str, allowed: Sequence[str] = ()) -> list[str]:
    """The Host header values a server listening on `host` answers to: this machine's own names (LOCAL_HOSTS),
    `host` itself and the `allowed` names (--allowed-host); any name ("*") when it listens on every interface
    (0.0.0.0, ::) and no `allowed` name narrows that, as the machine's names on the network are not known here."""
    every = _every_interface(host)
    if not allowed and every:
        return ["*"]
    hosts = _host_patterns([*LOCAL_HOSTS, *(() if every else (host,)), *allowed])
    return ["*"] if "*" in hosts else hosts


def _every_interface(host: str) -> bool:
    """Whether `host` listens on every interface: 0.0.0.0 or :: however written ("0", "0:0:0:0:0:0:0:0")."""
    if host in ALL_INTERFACES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a name
        return False


def _host_patterns(hosts: Sequence[str]) -> list[str]:
    """`hosts` as TrustedHostMiddleware matches them (lower case, IPv6 in brackets, each once), or ConfigError."""
    patterns = []
    for name in hosts:
        try:
            patterns.append(allowed_host(name))
        except argparse.ArgumentTypeError:
            raise ConfigError(f"allowed host {str(name)[:80]!r} is not a host name as a browser sends it",
                              hint=f"give {HOST_FORMS} (--allowed-host NAME; from Python, allowed_hosts=[...])"
                              ) from None
    return list(dict.fromkeys(patterns))


def create_app(searcher: Searcher, max_upload_bytes: int = MAX_UPLOAD_BYTES,
               allowed_hosts: Sequence[str] = LOCAL_HOSTS) -> FastAPI:
    """The FastAPI app over a loaded `Searcher` (tests use it with TestClient, `serve` with uvicorn).
    `allowed_hosts`: the Host header values it answers (`trusted_hosts`; "*" any); others get 400."""
    app = FastAPI(title="itmatch search", docs_url="/api/docs", openapi_url="/api/openapi.json",
                  default_response_class=SafeJSONResponse)
    metrics = Metrics()
    app.state.searcher, app.state.metrics = searcher, metrics
    hosts = _host_patterns(allowed_hosts)
    # (added before `measure`, so inside it: a refused request is counted and logged there)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)

    @app.middleware("http")
    async def measure(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", None) or ("/static" if request.url.path.startswith("/static/") else "other")
        metrics.record(f"{request.method} {name}", response.status_code, time.perf_counter() - start)
        if route is None and response.status_code == 400:  # (every other 400 is a route's: only the host check)
            log.warning("%s %s -> 400: refused the host name %r (answered: %s); if the server is reached by that "
                        "name, restart it with --allowed-host NAME (the name without its port)", request.method,
                        request.url.path, request.headers.get("host", ""), ", ".join(hosts))
        return response

    @app.exception_handler(QueryError)
    async def on_query_error(request: Request, exc: QueryError):
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return _error(exc.status, exc.message, exc.hint)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        log.warning("%s %s -> 422: %s", request.method, request.url.path, problems)
        return _error(422, f"invalid request: {problems}")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.detail)
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):  # a bug, not bad input: say so, keep serving
        log.exception("%s %s -> 500", request.method, request.url.path)
        return _error(500, f"internal error ({type(exc).__name__})")

    def hits(query: str, k: int) -> dict[str, Any]:
        start = time.perf_counter()
        results = [{**h.as_dict(), "url": image_url(h.id)} for h in searcher.search(query, k)]
        return {"query": query, "k": k, "unknown_words": searcher.unknown_words(query), "results": results,
                "took_ms": round(1000 * (time.perf_counter() - start), 2)}

    @app.get("/health")
    def health() -> dict[str, Any]:
        models = [{k: member.index.manifest["model"].get(k) for k in ("arch", "preset", "backbone")}
                  for member in searcher.members]
        # "model": the index's (the first); "models": every model a query is scored with (more: an ensemble)
        return {"status": "ok", "images": len(searcher.ids), "captions": len(searcher.captions),
                "model": models[0], "models": models, "explain": searcher.explains,
                "explain_note": searcher.explain_note}

    @app.get("/metrics")
    def get_metrics() -> dict[str, Any]:
        return metrics.snapshot()

    @app.get("/api/search")
    def search(q: str = Query("", description="text query"),
               k: int = Query(10, ge=1, le=MAX_K, description="results")):
        return hits(q, k)

    # The two POST routes are `async` to read their bodies as they stream in (read_body's limit); their model work
    # (decoding, the CNN, scoring, waiting for the Searcher's lock) runs on the thread pool, as the `def` routes'
    # does: on the event loop it would hold up every other request, /health and photo files included.
    @app.post("/api/search", openapi_extra={"requestBody": SEARCH_BODY})
    async def search_json(request: Request):
        query, k = parse_search_body(await read_body(request, MAX_JSON_BYTES, hint=JSON_HINT))
        return await run_in_threadpool(hits, query, k)

    def captions_of(data: bytes, k: int) -> dict[str, Any]:
        image = open_upload(data, max_upload_bytes)
        return {"k": k, "captions_without_known_word": len(searcher.captions_without_known_word),
                "results": searcher.search_image(image, k)}

    @app.post("/api/search/image", openapi_extra={"requestBody": IMAGE_BODY})
    async def search_image(request: Request, k: int = Query(10, ge=1, le=MAX_K, description="results")):
        return await run_in_threadpool(captions_of, await read_body(request, max_upload_bytes, hint=RESIZE), k)

    # HEAD too: a browser or a link checker asks whether a photo is there without fetching it (out of the schema,
    # where one function under two methods would have one operation id twice)
    @app.get("/api/images/{image_id:path}")
    @app.head("/api/images/{image_id:path}", include_in_schema=False)
    def image(image_id: str):
        return FileResponse(searcher.image_path(image_id))

    @app.get("/api/explain")
    def explain(q: str = Query("", description="text query"), id: str = Query("", description="image id")):
        if not id:
            raise QueryError("no image id given", status=400, hint="pass id=, an id as returned by the search")
        return {**searcher.explain(q, id), "url": image_url(id)}  # a deep link opens it without a search

    @app.get("/", include_in_schema=False)
    def page():
        return FileResponse(WEB_DIR / "index.html")

    @app.get("/index.html", include_in_schema=False)
    def page_alias():
        return RedirectResponse("/")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return app


def serve(index_dir: Path, *, host: str = "127.0.0.1", port: int = 8000, checkpoint: str | Path | None = None,
          ensemble: Sequence[Path | str] = (), captions: str | Path | None = None, images_dir: str | Path | None = None,
          log_level: str = "info", shortlist: int = 0, shortlist_index: str = "flat",
          device: str = "cpu", precision: str = "fp32", trust_modified: bool = False,
          allowed_hosts: Sequence[str] = ()) -> None:
    """Load the index (refusing a corrupt one or another model's), then serve until interrupted.
    `ensemble`: more indexes of the same photos, built with other models, whose scores are averaged (Searcher).
    `shortlist` N > 0: text queries re-rank the first stage's top N photos (Searcher).
    `allowed_hosts`: host names the server answers to besides this machine's own and `host` (`trusted_hosts`)."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hosts = trusted_hosts(host, allowed_hosts)  # (a bad name is said before anything is loaded)
    listening = listen(host, port)  # first: a port in use is said at once, not after the model has loaded
    searcher = Searcher(index_dir, checkpoint, ensemble=ensemble, images_dir=images_dir,
                        captions=read_captions_file(captions) if captions else None, shortlist=shortlist,
                        shortlist_index=shortlist_index, device=device, precision=precision,
                        trust_modified=trust_modified)
    if searcher.captions_without_known_word:
        log.warning("%d caption(s) of %s have no word in the model's vocabulary and are never ranked, e.g. %r",
                    len(searcher.captions_without_known_word), captions, searcher.captions_without_known_word[0])
    if searcher.explain_note:
        log.info(searcher.explain_note)
    if not searcher.images_root.is_dir():  # (the page would show every result without its photo)
        from itmatch.retrieval.index import moved_folder_hint

        log.warning("the photo folder %s is not there: results will come without their photos; %s",
                    searcher.images_root, moved_folder_hint(index_dir, searcher.index.manifest))
    if 0 < shortlist < min(MAX_K, len(searcher.ids)):  # (the page asks for up to 48)
        log.info("--shortlist %d: a text search returns at most %d photos, whatever k it asks for", shortlist,
                 shortlist)
    bound = listening.getsockname()[1]  # (the port itself when --port 0 let the system choose)
    log.info("serving %d images of %s on http://%s:%d/", len(searcher.ids), index_dir, url_host(host), bound)
    if ensemble:
        log.info("each photo is ranked by the mean score of %d models: %s", len(searcher.members),
                 ", ".join(member.name for member in searcher.members))
    _log_exposure(host, bound, hosts)
    # keep-alive longer than uvicorn's 5 s: under load a pooled client connection can sit idle that long,
    # and a server-side close racing the client's next request shows up as a connection error
    config = uvicorn.Config(create_app(searcher, allowed_hosts=hosts), host=host, port=port, log_level=log_level,
                            timeout_keep_alive=30, backlog=BACKLOG)
    uvicorn.Server(config).run(sockets=[listening])


def _log_exposure(host: str, port: int, hosts: list[str]) -> None:
    """Say who can reach the server (it has no authentication) and under which names it answers."""
    if not _loopback(host):
        log.warning("the server has no authentication: anyone who can reach this machine on port %d can search the "
                    "index and fetch every indexed photo (serve on --host 127.0.0.1 to keep it to this machine)", port)
    if hosts == ["*"]:
        log.info("answering requests under any host name (--allowed-host NAME answers only NAME and this "
                 "machine's own names, against web pages that reach the server under a name of theirs)")
    else:
        log.info("answering requests for the host names %s (--allowed-host NAME adds one)", ", ".join(hosts))


def _loopback(host: str) -> bool:
    """Whether `host` is an address (or the name) of this machine only, which no other machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: whatever it resolves to, others may reach it
        return False


BACKLOG = 2048  # connections waiting to be accepted (uvicorn's default)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for the server (ConfigError when it cannot be: in use, or not this machine's
    address), as uvicorn binds one, so that it serves on this very socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (uvicorn's own: a restart need not wait)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {url_host(host)}:{port}: {exc.strerror or exc}",
                          hint=_listen_hint(exc.errno)) from None
    # listening from here, not from when uvicorn takes the socket: a client that connects once "serving ..." is
    # logged waits in the backlog for the server to start instead of being refused (a script that waited for the
    # line, as tests/retrieval/test_search_ensemble.py does, met "Connection refused" in two runs of six)
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def _listen_hint(code: int | None) -> str:
    """What to change when the socket cannot be bound, by the system's reason (errno)."""
    if code == errno.EADDRNOTAVAIL:  # (an address of another machine, or of an interface that is down)
        return ("--host must be an address of this machine: pass --host 127.0.0.1 (this machine only) or --host "
                "0.0.0.0 (every interface, reachable from the network)")
    if code == errno.EACCES:
        return "ports below 1024 need administrator rights: pass --port 8000 (or another above 1023)"
    return "pass another --port, or stop what listens there"
