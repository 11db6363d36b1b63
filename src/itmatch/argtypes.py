"""argparse `type=` validators shared by every `itmatch` verb: numbers within their range, ports, hosts, input
paths that exist and output paths that can be written. A bad value becomes argparse's usage error (exit 2,
one line naming the argument) before any work starts, instead of a traceback halfway through a command.

Each validator keeps what it checks in attributes (`kind`, `low`, `high`) so that a test can walk every
argument of every verb and feed it values just outside its range (tests/test_cli_args.py)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import math
import os
import re
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from itmatch.errors import ConfigError
from itmatch.io import figure_format

Validator = Callable[[str], Any]
DEVICE_FORM = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$", re.IGNORECASE)
#: the form of a shipped model's name (itmatch.pretrained.NAME)
PRETRAINED_NAME = re.compile(r"^[a-z0-9][a-z0-9_.+-]*$")
#: a DNS name: dot-separated labels of letters, digits, '-' and '_' (not at a label's ends), a final dot allowed
HOST_FORMS = "a name (photos.local), an address (192.168.1.5, ::1), *.example.com or *, without a scheme or a port"
HOST_NAME = re.compile(r"^(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.?$")


def _named(kind: str, **attrs: Any) -> Callable[[Validator], Validator]:
    """Tag a validator with what it checks; argparse shows `__name__` when a validator raises ValueError."""
    def tag(fn: Validator) -> Validator:
        fn.kind, fn.__name__ = kind, kind.replace("_", " ")
        for name, value in attrs.items():
            setattr(fn, name, value)
        return fn
    return tag


def int_in(low: int, high: int | None = None) -> Validator:
    """An integer in [low, high] (no upper bound when high is None)."""
    span = f">= {low}" if high is None else f"between {low} and {high}"

    @_named("int", low=low, high=high)
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not a number, or more digits than Python converts
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {text[:40]!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {value}")
        return value
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
port = int_in(1, 65535)


@_named("float", low=0.0, high=None)
def positive_float(text: str) -> float:
    """A finite number > 0 (a memory budget)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text[:40]}")
    return value


@_named("host")
def host(text: str) -> str:
    """An address to listen on: an IP address or a name this machine resolves."""
    try:
        socket.getaddrinfo(text, None)
    except (OSError, UnicodeError, ValueError) as exc:  # ValueError: a NUL in the name
        raise argparse.ArgumentTypeError(f"cannot resolve host {text!r} ({exc}); "
                                         "use an address such as 127.0.0.1 or 0.0.0.0") from None
    return text


@_named("allowed_host")
def allowed_host(text: str) -> str:
    """A name the server may be reached by, as a browser writes it in the Host header (Starlette's
    TrustedHostMiddleware pattern): a host name, an IP address (IPv6 with or without its brackets),
    `*.example.com` (its sub-domains) or `*` (any name). Lower-cased; an IPv6 address in brackets, the Host form."""
    name = text.strip().lower()
    if name == "*":
        return name
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(name[1:-1] if name.startswith("[") and name.endswith("]") else name)
        return f"[{address}]" if address.version == 6 else str(address)
    if not HOST_NAME.match(name.removeprefix("*.")):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a host name as a browser sends it: give {HOST_FORMS}")
    return name


def _given(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"path {text!r} contains a NUL byte")
    return Path(text)


def _existing(text: str, want_dir: bool) -> str:
    """`text` if it names an existing directory (`want_dir`) or file, else why not."""
    path = _given(text)
    if path.is_dir() if want_dir else path.is_file():
        return text
    what = ("is a file, not a directory" if path.exists() else "does not exist") if want_dir else (
        "is a directory, not a file" if path.is_dir() else "does not exist")
    raise argparse.ArgumentTypeError(f"{text} {what}")


@_named("existing_dir")
def existing_dir(text: str) -> str:
    """An input directory that exists."""
    return _existing(text, want_dir=True)


def device_form(text: str) -> str:
    """auto, cpu, cuda or cuda:N (any case), by form only, lower-cased: whether this machine has that device is
    checked when the work starts (itmatch.device.resolve names what is available), without importing torch.
    A ConfigError otherwise (train.device's check, `option(check=...)`)."""
    if not DEVICE_FORM.match(text.strip()):
        raise ConfigError(f"{text!r} is not a device", hint="use auto, cpu, cuda or cuda:N")
    return text.strip().lower()


@_named("device")
def device_name(text: str) -> str:
    """`device_form` of the --device flag."""
    try:
        return device_form(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{exc.message}: {exc.hint}") from None


@_named("checkpoint_ref")
def checkpoint_ref(text: str) -> str:
    """A checkpoint directory that exists, or a name of the form of a pretrained model shipped with the
    package (whether that model exists is checked when the verb starts, by itmatch.pretrained, which names
    the shipped ones; the parser does not import torch)."""
    path = _given(text)
    if path.is_dir() or (not path.exists() and PRETRAINED_NAME.match(text)):
        return text
    what = "is a file, not a checkpoint directory" if path.exists() else "is neither a directory nor a pretrained model"
    raise argparse.ArgumentTypeError(f"{text} {what} (`itmatch models --pretrained` lists the shipped ones)")


@_named("existing_file")
def existing_file(text: str) -> str:
    """An input file that exists (a directory is refused)."""
    return _existing(text, want_dir=False)


def _check_creatable(text: str, path: Path) -> Path:
    """The nearest existing ancestor of `path` must be a directory we may create entries in; returns it."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} is not writable")
    return parent


@_named("output_dir")
def output_dir(text: str) -> str:
    """An output directory: absent (then creatable) or an existing writable directory, never a file."""
    path = _given(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file; an output directory is needed there")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text} is not writable")
    else:
        _check_creatable(text, path)
    return text


@_named("output_file")
def output_file(text: str) -> str:
    """An output file: absent or a file, never a directory, in a directory we may write (files are replaced
    atomically, through a temporary file beside them).

    An output file is written when the work is done, maybe hours later, so the directory is also tried: a file
    is created there and removed. Permission bits do not tell (root passes them where a filesystem refuses
    every file, as /sys does); an output directory needs no such try, the verbs create theirs first."""
    path = _given(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; an output file name is needed there")
    # (missing folders are created with the file: their nearest existing one is where the file is tried)
    parent = _check_creatable(text, path)
    try:
        handle, probe = tempfile.mkstemp(dir=parent, prefix=".itmatch-probe-")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} refuses new files ({exc.strerror})"
                                         ) from None
    os.close(handle)
    os.unlink(probe)
    return text


@_named("figure_file")
def figure_file(text: str) -> str:
    """An output file for a figure (output_file) whose suffix names a format it can be written in (.png, .svg,
    .pdf, ...: itmatch.io.FIGURE_FORMATS): r.svg held PNG bytes before, whatever its name said."""
    output_file(text)
    try:
        figure_format(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.message}; {exc.hint}") from None
    return text
