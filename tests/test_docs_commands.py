"""Every command the README and docs/ show still means something. For `itmatch`: its verb exists, each option it
names is one of that verb's, a `--preset` is a preset, a `--set` key is a config key, a `--config` file is in the
repository, and a whole command (a code block's line) parses, its paths taken as the examples they are. For
`bench/flickr8k.py`: the command parses and each `--row` is a row of its `--config`. Docs rot silently when an
option or a row is renamed; this is where they stop doing so."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

import pytest
from conftest import load_script

from itmatch.cli import build_parser
from itmatch.config import MOVED_KEYS, Config
from itmatch.models.registry import list_models

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `itmatch VERB` (also `python -m itmatch VERB`, torchrun's `-m itmatch VERB`), not `itmatch serve: error: ...`
ITMATCH = re.compile(r"(?:^|[\s`(])itmatch ([a-z]+)(?=\s|$)")
BENCH = re.compile(r"bench/flickr8k\.py(?=\s|$)")
# scripts/device_session.py's verbs that run rows; docs/gpu.md's queue writes them without the script's name
DEVICE = re.compile(r"(?:device_session\.py |^)((?:kickoff|start) --)")
# Validators of paths (they would stat the docs' placeholders, PHOTOS or RUN/best); every other type stays.
PATH_KINDS = {"existing_dir", "existing_file", "checkpoint_ref", "output_dir", "output_file", "figure_file"}


@dataclasses.dataclass(frozen=True)
class Command:
    program: str  # "itmatch", "bench" (bench/flickr8k.py) or "device" (scripts/device_session.py)
    where: str  # page:line
    words: tuple[str, ...]  # after the program's name
    whole: bool  # a code block's line (a whole command), not an inline mention of some of its options

    def __str__(self) -> str:
        return f"{self.where}: `{self.program} {' '.join(self.words)}`"


def _commands() -> list[Command]:
    found = []
    for page in PAGES:
        name, in_block, pending, start = str(page.relative_to(ROOT)), False, "", 0
        prose: list[tuple[int, str]] = []  # the paragraph so far: an inline span may wrap onto the next line
        for number, line in [*enumerate(page.read_text(encoding="utf-8").splitlines(), 1), (0, "")]:
            if in_block or line.lstrip().startswith("```") or not line.strip():
                found += _spans(name, prose)
                prose = []
            if line.lstrip().startswith("```"):
                in_block = not in_block
            elif in_block:  # a line, or several joined by trailing backslashes
                start = start if pending else number
                pending += line.rstrip().removesuffix("\\") + " "
                if not line.rstrip().endswith("\\"):
                    found += _read(f"{name}:{start}", pending, whole=True)
                    pending = ""
            elif line.strip():
                prose.append((number, line))
    return found


def _spans(name: str, paragraph: list[tuple[int, str]]) -> list[Command]:
    text = " ".join(line for _, line in paragraph)
    starts = [n for n, line in paragraph for _ in range(len(line) + 1)]  # the line of each character
    return [c for span in re.finditer(r"`([^`]+)`", text)
            for c in _read(f"{name}:{starts[span.start()]}", span.group(1), whole=False)]


def _read(where: str, text: str, whole: bool) -> list[Command]:
    text = re.split(r"\s#\s", text)[0].split("|")[0]  # a shell comment; what the command is piped into
    if "$" in text or "<" in text:  # shell variables and <placeholders> are not commands
        return []
    for program, pattern in (("itmatch", ITMATCH), ("bench", BENCH), ("device", DEVICE)):
        match = pattern.search(text)
        if match is None:
            continue
        rest = text[match.start(1) if program != "bench" else match.end():]
        rest = re.sub(r"\[|\]|\.\.\.|…", " ", rest)  # [optional] parts are read as given; "..." is elided text
        try:
            return [Command(program, where, tuple(shlex.split(rest)), whole)]
        except ValueError:  # an unclosed quote in prose
            return []
    return []


COMMANDS = _commands()


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """'train' -> its parser, and nested verbs as 'analyze perturb'."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found |= _subparsers(sub, f"{prefix}{name} ")
    return found


def _config_keys() -> set[str]:
    def walk(obj: object, prefix: str) -> set[str]:
        keys = set()
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            keys |= walk(value, f"{prefix}{field.name}.") if dataclasses.is_dataclass(value) else set()
            keys.add(f"{prefix}{field.name}")
        return keys
    return walk(Config(), "") | set(MOVED_KEYS)


VERBS = _subparsers(build_parser())
PRESETS = set(list_models())
KEYS = _config_keys()


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/flickr8k.py")


def test_the_docs_show_commands_of_every_kind():
    """(the reading of the pages itself: a change in their form must not leave the tests below checking nothing)"""
    itmatch = [c for c in COMMANDS if c.program == "itmatch"]
    assert len(itmatch) > 100 and sum(c.whole for c in itmatch) > 25
    assert {c.words[0] for c in itmatch} >= {"train", "evaluate", "extract", "index", "search", "serve", "analyze"}
    assert sum(c.program == "bench" for c in COMMANDS) > 30 and sum(c.program == "device" for c in COMMANDS) > 8


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "itmatch"], ids=lambda c: c.where)
def test_itmatch_command_names_a_verb_and_its_own_options(command: Command):
    words = list(command.words)
    verb = words.pop(0)
    if words and f"{verb} {words[0]}" in VERBS:
        verb = f"{verb} {words.pop(0)}"
    assert verb in VERBS, f"{command}: `itmatch {verb}` is not a verb"
    options = VERBS[verb]._option_string_actions
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, _, inline = word.partition("=")
        assert name in options, f"{command}: `itmatch {verb}` has no option {name}"
        value = inline or (words[i + 1] if i + 1 < len(words) else "")
        if name == "--preset" and value.islower():  # (lowercase: a name, not a placeholder such as P)
            assert value in PRESETS, f"{command}: no preset {value!r}"
        if name == "--set" and "=" in value:
            assert value.split("=", 1)[0] in KEYS, f"{command}: no config key {value.split('=', 1)[0]!r}"
        if name == "--config" and value.startswith("configs/"):
            assert (ROOT / value).is_file(), f"{command}: no config file {value}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "itmatch" and c.whole],
                         ids=lambda c: c.where)
def test_itmatch_whole_command_parses(command: Command, monkeypatch):
    parser = build_parser()
    for sub in _subparsers(parser).values():
        for action in sub._actions:
            if getattr(action.type, "kind", None) in PATH_KINDS:
                monkeypatch.setattr(action, "type", str)
    try:
        parser.parse_args(list(command.words))
    except SystemExit as stop:
        pytest.fail(f"{command} does not parse (exit {stop.code})")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "bench"  # (ROW, PRESET: placeholders)
                                     and not any(re.fullmatch(r"[A-Z]+", w) for w in c.words)], ids=lambda c: c.where)
def test_bench_command_parses_and_names_rows_of_its_schedule(command: Command, bench):
    words = list(command.words)
    if "--row" in words and words.index("--row") == len(words) - 1:  # "... --row" followed by prose
        words.pop()
    try:
        bench.parse_arguments(words)
    except SystemExit as stop:
        pytest.fail(f"{command} does not parse, or names a row its --config does not have (exit {stop.code})")


@pytest.fixture(scope="module")
def device_session():
    return load_script("scripts/device_session.py")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "device"], ids=lambda c: c.where)
def test_device_session_command_parses_and_names_rows_of_the_gpu_table(command: Command, bench, device_session):
    """The GPU queue's commands (a misspelt row there costs a lent machine's call before `poll` shows it)."""
    try:
        args = device_session.build_parser().parse_args(list(command.words))
    except SystemExit as stop:
        pytest.fail(f"{command} does not parse (exit {stop.code})")
    unknown = set(args.row) - set(bench.GPU.rows)
    assert not unknown, f"{command}: not rows of --config gpu: {unknown}"
    assert set(args.perturb) <= set(bench.PERTURB), f"{command}: no perturbation study of {args.perturb}"
