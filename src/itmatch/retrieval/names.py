"""Image ids that any file name the filesystem returns can have, and that survive JSON, URLs, HTML and
terminals.

On Linux a file name is bytes: Python hands it over as a `str` in which bytes that are not UTF-8 are
lone surrogates (PEP 383 "surrogateescape", `caf\\xe9.jpg` -> 'caf\\udce9.jpg'). Such a string cannot be
encoded as UTF-8, so it breaks JSON responses, URLs and strict terminals; names may also hold newlines,
tabs, bidirectional overrides or other characters that are invisible or rewrite the line they are shown
in. The index keeps the name as the filesystem gave it (the manifest's `id`, the path to open); what
leaves the process is `public_id(name)`:

- every printable character (`str.isprintable`, the rule `repr()` uses) is kept, except `\\`;
- `\\` becomes `\\\\`; newline, carriage return and tab become `\\n`, `\\r`, `\\t`; a byte that is not
  UTF-8 becomes `\\xhh`; any other character (control, format such as a bidirectional override,
  separator other than the space) becomes `\\uhhhh` or `\\Uhhhhhhhh`.

So an ordinary name (printable UTF-8 without a backslash: nearly all of them) is its own id, unchanged
from the relative path; the mapping is one-to-one (a literal backslash is always doubled, so an escape
cannot be confused with the characters it spells), and the id is always valid UTF-8 text without control
characters. It is text to display, never markup: the web page writes it with `textContent`.
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
    """The id of a relative path as the filesystem returned it (see the module's docstring)."""
    if name.isprintable() and "\\" not in name:  # the common case, and surrogates are not printable
        return name
    return "".join(_escape_char(c) for c in name)
