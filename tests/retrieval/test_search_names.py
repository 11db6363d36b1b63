"""File names that are not UTF-8 or are hostile (markup, quotes, `#`, `?`, `%`, newlines, leading dashes,
255 bytes, odd sub-folders): indexed, searched, served and shown, end to end (index -> CLI -> HTTP)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import HOSTILE_NAMES, serving

from itmatch.cli import main
from itmatch.retrieval.index import build_index, load_index
from itmatch.retrieval.names import public_id
from itmatch.retrieval.search import QueryError, Searcher

QUERY = "a red circle"
ESCAPE = re.compile(r"\\(\\|[nrt]|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")


def _name_of(image_id: str) -> bytes:
    """The reverse of public_id, written out independently: the file name's bytes."""
    out, pos = bytearray(), 0
    for m in ESCAPE.finditer(image_id):
        out += image_id[pos:m.start()].encode()
        code = m.group(1)
        if code[0] == "x":
            out.append(int(code[1:], 16))
        elif code[0] in "uU":
            out += chr(int(code[1:], 16)).encode()
        else:
            out += {"\\": b"\\", "n": b"\n", "r": b"\r", "t": b"\t"}[code]
        pos = m.end()
    assert "\\" not in image_id[pos:], f"a lone backslash in {image_id!r}"
    return bytes(out + image_id[pos:].encode())


def test_public_id_is_printable_utf8_and_one_to_one():
    tricky = [b"caf\xe9", b"caf\\xe9", b"a\nb", b"a\\nb", b"a\\\\nb", b"\\", b"\\\\", b"x\x7f\x00y", b"\xed\xa0\x80"]
    for name in [*HOSTILE_NAMES, *tricky]:
        image_id = public_id(os.fsdecode(name))
        assert image_id.isprintable() and image_id.encode("utf-8")  # JSON-, URL- and terminal-safe
        assert _name_of(image_id) == name  # nothing lost: one id per name
    assert [public_id(os.fsdecode(n)) for n in HOSTILE_NAMES] == list(HOSTILE_NAMES.values())
    assert public_id("sub/test_00001.png") == "sub/test_00001.png"  # ordinary names are their own id


@pytest.fixture(scope="module")
def hostile_index(tiny_search_setup, hostile_photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("names") / "index"
    summary = build_index(hostile_photos, tiny_search_setup["checkpoint"], out, progress=False)
    assert summary["images"] == len(HOSTILE_NAMES) and not summary["skipped"]
    return out


def test_every_name_is_indexed_and_searchable(hostile_index, hostile_photos):
    assert sorted(os.fsencode(i) for i in load_index(hostile_index).ids) == sorted(HOSTILE_NAMES)
    searcher = Searcher(hostile_index)
    hits = searcher.search(QUERY, k=len(HOSTILE_NAMES))
    assert sorted(h.id for h in hits) == sorted(HOSTILE_NAMES.values())
    for h in hits:
        assert searcher.image_path(h.id).read_bytes() == (hostile_photos / os.fsdecode(_name_of(h.id))).read_bytes()
    for raw in ("caf\udce9.png", "new\nline\ttab.png"):  # the filesystem's form is not an id: one scheme only
        with pytest.raises(QueryError):
            searcher.row_of(raw)


def test_http_search_photos_and_explain_for_every_name(hostile_index, hostile_photos):
    pytest.importorskip("uvicorn", reason="the `serve` extra (fastapi, uvicorn) is not installed")
    import httpx

    from itmatch.retrieval.service import create_app

    with serving(create_app(Searcher(hostile_index))) as base, httpx.Client(base_url=base, timeout=30) as client:
        resp = client.get("/api/search", params={"q": QUERY, "k": len(HOSTILE_NAMES)})
        assert resp.status_code == 200, resp.text  # was a 500 (UnicodeEncodeError) with a non-UTF-8 name
        results = resp.json()["results"]
        assert sorted(r["id"] for r in results) == sorted(HOSTILE_NAMES.values())
        for r in results:
            photo = client.get(r["url"])
            assert photo.status_code == 200, (r["id"], r["url"], photo.text)
            assert photo.content == (hostile_photos / os.fsdecode(_name_of(r["id"]))).read_bytes()
            explained = client.get("/api/explain", params={"q": QUERY, "id": r["id"]})
            assert explained.status_code == 200, (r["id"], explained.text)
            assert explained.json()["id"] == r["id"] and explained.json()["url"] == r["url"]
        for smuggled in ("caf%E9.png", "caf%ED%B3%A9.png", "new%0Aline%09tab.png"):  # raw bytes are not ids
            assert client.get("/api/images/" + smuggled).status_code == 404


def test_cli_prints_every_name_escaped(hostile_index, hostile_photos, capsys):
    """capsys's stdout is strict UTF-8, like a terminal under en_US.UTF-8 (not C.UTF-8, whose surrogateescape
    printed the raw bytes): the CLI prints ids and paths escaped, one result a line."""
    k = str(len(HOSTILE_NAMES))
    assert main(["search", str(hostile_index), QUERY, "-k", k]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(HOSTILE_NAMES)  # no name broke a line
    assert any(line.endswith("/caf\\xe9.png") for line in lines)
    assert main(["search", str(hostile_index), QUERY, "-k", k, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert sorted(r["id"] for r in results) == sorted(HOSTILE_NAMES.values())
    for r in results:
        assert r["path"] == public_id(str(hostile_photos.resolve() / os.fsdecode(_name_of(r["id"]))))


def _make_deep_folder(root: Path, levels: int) -> None:
    """Nested folders of 240-byte names, the deepest holding a photo file, made relative to each other:
    the full path is longer than the system's limit (4096 bytes), so it cannot be listed by its path."""
    fd = os.open(root, os.O_RDONLY)
    for i in range(levels):
        name = f"d{i:02d}" + "x" * 237
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("photo.png", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)


def test_entries_that_cannot_be_read_are_skipped_with_a_warning_naming_them(tiny_search_setup, hostile_photos,
                                                                            tmp_path, caplog, capsys):
    photos = tmp_path / "photos"
    shutil.copytree(hostile_photos, photos)
    os.symlink(b"nowhere.png", bytes(photos) + b"/gone \xe9\n.png")  # a dangling link: no file to hash or read
    (photos / "folder.png").mkdir()  # a folder with an image's suffix is a folder
    _make_deep_folder(photos, levels=18)  # a path of over 4096 bytes: a folder that cannot be listed
    with caplog.at_level("WARNING", logger="itmatch.retrieval"):
        assert main(["index", str(photos), "--model", str(tiny_search_setup["checkpoint"]),
                     "--out", str(tmp_path / "index"), "--quiet"]) == 0
    assert f"{len(HOSTILE_NAMES)} images" in capsys.readouterr().out
    assert "gone \\xe9\\n.png" in caplog.text
    assert "cannot list the folder d00" + "x" * 237 + "/d01" in caplog.text and "too long" in caplog.text
    summary = build_index(photos, tiny_search_setup["checkpoint"], tmp_path / "index", progress=False)
    assert [public_id(s["id"]) for s in summary["skipped"]] == ["gone \\xe9\\n.png"]
    assert summary["encoded"] == 0 and summary["images"] == len(HOSTILE_NAMES)
