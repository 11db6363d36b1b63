"""Image ids that any file name the filesystem returns can have, and that survive JSON, URLs, HTML and
terminals: `public_id(name)` escapes what is not printable UTF-8, one-to-one, and leaves an ordinary name as it
is. The index keeps the name as the filesystem gave it; what leaves the process is its id.
The escaping rules and why: docs/search.md, 'File names and image ids'.
"""

from __future__ import annotations

BAD_BYTES = range(0xDC80, 0xDD00)  # where surrogateescape puts a byte 0x80..0xff that is not UTF-8
SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape_char(char: str) -> str:
    code = ord(char)
    if code in BAD_BYTES:
        return f"\\x{code - 0xDC00:02x}"
    if char in SHORT_ESCAPES:
        return SHORT_ESCAPES[char]
    if char.isprintable():
        return char
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def public_id(name: str) -> str:
    """The id of a relative path as the filesystem returned it (docs/search.md, 'File names and image ids')."""
    if name.isprintable() and "\\" not in name:  # the common case, and surrogates are not printable
        return name
    return "".join(_escape_char(c) for c in name)
