"""What a search request may ask for, the same in the CLI and the HTTP API (docs/search.md, 'Limits'). A module
of its own, without torch, so that the command-line parser checks `-k` before any model is loaded."""

from __future__ import annotations

MAX_QUERY_CHARS = 300
MAX_QUERY_WORDS = 40
MAX_K = 100
MAX_UPLOAD_BYTES = 10 * 1024 * 1024
MAX_PIXELS = 40_000_000  # ~ a 7300 x 5500 photo; larger is refused before decoding (decompression bombs)
