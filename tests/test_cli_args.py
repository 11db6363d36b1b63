"""Every numeric and path argument of every verb is validated before any work starts: a bad value is a
one-line usage error naming the argument, exit code 2, no traceback. A reader that closes the pipe early
(`itmatch models | head -1`) is not an error."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from itmatch.argtypes import output_dir, output_file
from itmatch.cli import build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src"

# Arguments that take free text or a name checked later against a list (presets, splits, config keys).
FREE_TEXT = {"preset", "name", "set", "split", "splits", "scales", "backbone", "query", "caption", "command", "dataset",
             "perturbations", "labels", "title", "paper"}


def _verbs() -> dict[str, argparse.ArgumentParser]:
    """'train' -> its parser; nested verbs as 'analyze perturb'."""
    def children(parser: argparse.ArgumentParser, prefix: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                        yield from children(sub, f"{prefix}{name} ")
                    else:
                        yield f"{prefix}{name}", sub
    return dict(children(build_parser(), ""))


def _value_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Arguments that take a value (not flags, --help or a fixed list of choices)."""
    return [a for a in parser._actions if a.nargs != 0 and not a.choices and a.dest != "help"]


def _name(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


def test_every_numeric_and_path_argument_has_a_validator():
    """A new argument must either get a validator from itmatch.argtypes or be listed as free text here."""
    unchecked = [f"{verb} {_name(a)}" for verb, parser in _verbs().items() for a in _value_arguments(parser)
                 if getattr(a.type, "kind", None) is None and a.dest not in FREE_TEXT]
    assert not unchecked, f"arguments without a validator: {unchecked}"


def _bad_values(kind: str, validator) -> list[str]:
    if kind == "int":
        out = [str(validator.low - 1), "ten", "2.5", "1" * 5000]
        return out + ([str(validator.high + 1)] if validator.high is not None else [])
    return {"float": ["0", "-1", "nan", "inf", "lots"],
            "host": ["no such host!"],
            "allowed_host": ["photos.lan:8000", "http://photos.lan", "*photos", "no such host!", ""],
            "existing_dir": ["{missing}", "{file}", ""],
            "checkpoint_ref": ["{missing}", "{file}", ""],
            "device": ["gpu", "cuda:x", "cuda:-1", ""],
            "existing_file": ["{missing}", "{dir}", "{file}\x00"],
            "output_dir": ["{file}", "{file}/sub"],
            "output_file": ["{dir}", "{file}/metrics.json"],
            "figure_file": ["{dir}", "{file}/fig.png", "{new}.xyz", "{new}"]}[kind]


GOOD = {"existing_dir": "{dir}", "checkpoint_ref": "{dir}", "device": "cpu",
        "existing_file": "{file}", "output_dir": "{new}", "output_file": "{new}.json", "figure_file": "{new}.svg",
        "int": None, "float": "1", "host": "127.0.0.1", "allowed_host": "photos.lan", None: "x"}


def _argv(verb: str, tested: str | None = None, value: str | None = None) -> list[str]:
    """The verb with its required arguments filled with good values, and the argument `tested` given `value`."""
    parser = _verbs()[verb]
    argv = verb.split()
    for action in _value_arguments(parser):
        if _name(action) == tested:
            given = value
        elif action.required:  # positionals other than `nargs="?"`, and required options
            kind = getattr(action.type, "kind", None)
            given = str(action.type.low) if kind == "int" else GOOD[kind]
        else:
            continue
        argv += [action.option_strings[0], given] if action.option_strings else [given]
    return argv


CASES = [(verb, _name(a), bad) for verb, parser in _verbs().items() for a in _value_arguments(parser)
         if getattr(a.type, "kind", None) for bad in _bad_values(a.type.kind, a.type)]


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    return {"dir": str(tmp_path / "dir"), "file": str(tmp_path / "file"), "missing": str(tmp_path / "missing"),
            "new": str(tmp_path / "new")}


@pytest.mark.parametrize(("verb", "argument", "bad"), CASES, ids=[f"{v}-{a}-{b[:12]!r}" for v, a, b in CASES])
def test_bad_value_is_a_one_line_usage_error(verb, argument, bad, paths, capsys):
    argv = [token.format(**paths) for token in _argv(verb, argument, bad)]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"itmatch {verb}: error: argument {argument}"), err


@pytest.mark.parametrize("verb", sorted(_verbs()))
def test_good_values_pass_the_validators(verb, paths):
    """Existing output directories and files are accepted too (the verbs decide about --force)."""
    parser = build_parser()
    args = parser.parse_args([token.format(**paths) for token in _argv(verb)])
    assert args.func
    for action in _value_arguments(_verbs()[verb]):
        kind = getattr(action.type, "kind", None)
        if kind in ("output_dir", "output_file"):
            existing = paths["dir"] if kind == "output_dir" else paths["file"]
            assert action.type(existing) == existing


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_output_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for target in (locked, locked / "run"):
        with pytest.raises(argparse.ArgumentTypeError, match="not writable"):
            output_dir(str(target))


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux /sys (where no file may be created)")
def test_an_output_file_where_no_file_can_be_created_is_refused_before_any_work(tmp_path):
    """(`evaluate --json /sys/ev.json` scored every pair and failed at the end, naming its temporary file: /sys
    passes the permission bits for root.) Trying leaves nothing behind where it works."""
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create /sys/itmatch.json"):
        output_file("/sys/itmatch.json")
    assert output_file(str(tmp_path / "new" / "metrics.json")) and not list(tmp_path.iterdir())


def test_reader_leaving_the_pipe_is_not_an_error_and_the_command_carries_on(monkeypatch):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the first line
    with open(write_end, "w", buffering=1) as stream:  # line-buffered: every print meets the closed pipe
        monkeypatch.setattr(sys, "stdout", stream)
        assert main(["models"]) == 0


def test_models_shows_each_presets_paper_row_and_filters_by_it(capsys):
    """One line per preset: name, arch, the paper row it reproduces, epochs and lr; --settings adds the model
    settings it changes, --paper TEXT keeps the presets whose name or row contains TEXT."""
    from itmatch.models.registry import PAPER_ROWS, list_models

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list_models()
    scan = lines[list_models().index("scan_t2i_avg")]
    assert scan.split()[:2] == ["scan_t2i_avg", "scan"] and "direction=" not in scan
    assert scan.endswith("SCAN Tables 1, 3: t-i AVG  (epochs 30, lr 0.0002)")
    assert main(["models", "--paper", "save table 1", "--settings"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["save_asa_both", "save_asa_ms2_both", "save_asa_ms3_both",
                                                   "save_dsa_both"]
    assert "ASA + ms2, CNN frozen (the paper trains it end to end)  (epochs 30, lr 0.0002)  direction=both " in lines[1]
    assert main(["models", "--paper", "oan_no_attn"]) == 0
    assert capsys.readouterr().out.startswith("oan_no_attn            oan      OAN Table 2: No attention  (epochs 24")
    # a row of several tables counts for each ("Tables 1, 3", "Tables 3-5", "Tables I, II, IV"), the words anywhere
    for query, wanted in (("scan table 3", {"scan_t2i_avg", "scan_i2t_avg", "summax_t2i", "summax_i2t"}),
                          ("save table 5", {"save_dsa", "save_asa", "save_dsa_ms2", "save_asa_ms3"}),
                          ("sman table iv", {"sman_inter", "sman_inter_alpha1"})):
        assert main(["models", "--paper", query]) == 0
        found = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
        assert wanted <= found and all(query.split()[0] in PAPER_ROWS[name].lower() for name in found), found
    for argv, said in ((["models", "--paper", "table 12"], "no preset's name or paper row contains every word of"),
                       (["models", "--pretrained", "--settings"], "list presets, not the shipped models")):
        assert main(argv) == 2
        assert said in capsys.readouterr().err


def _run_cli(*args: str, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "itmatch", *args], stderr=subprocess.PIPE, env=env, timeout=120,
                          **popen)


@pytest.mark.slow
def test_models_into_a_closed_pipe_or_closed_stdout_exits_quietly():
    """`itmatch models | head -1` (the reader gone before the output: it used to end in a BrokenPipeError
    traceback, exit 1) and `itmatch models >&-`: exit 0, nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        piped = _run_cli("models", stdout=write_end)
    finally:
        os.close(write_end)
    assert (piped.returncode, piped.stderr) == (0, b"")
    closed = _run_cli("models", stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    assert (closed.returncode, closed.stderr) == (0, b"")


# -- errors of the operating system in the middle of a command (docs/reliability.md row 23) ------------------
def _one_line_error(err: str, verb: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"itmatch {verb}: error: "), err
    return err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (where no file may be created)")
def test_os_error_mid_command_is_one_line_naming_the_file(capsys):
    """/proc passes the argument checks (it exists and is writable by permission bits for root) but the
    kernel refuses to create anything in it: the verb's mkdir fails with a real OSError."""
    target = "/proc/itmatch-cannot-create-this"
    assert main(["synth", target, "--train", "2", "--dev", "1", "--test", "1"]) == 1
    err = _one_line_error(capsys.readouterr().err, "synth")
    assert f"{target}: " in err and "(ENOENT)" in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device that is always full)")
def test_disk_full_is_one_line(monkeypatch, capsys):
    full = open("/dev/full", "w", buffering=1)  # noqa: SIM115 (line-buffered: the first print meets the full device)
    try:
        monkeypatch.setattr(sys, "stdout", full)
        assert main(["models"]) == 1
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):  # closing flushes what the failed write left in the buffer
            full.close()
    err = _one_line_error(capsys.readouterr().err, "models")
    assert "No space left on device (ENOSPC)" in err


def test_a_bug_is_not_hidden_as_an_os_error(monkeypatch, tmp_path):
    """Only OSError is turned into a one-line message; any other exception keeps its traceback."""
    import itmatch.data.synth as synth

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(synth, "render_synthetic", broken)
    with pytest.raises(ZeroDivisionError):
        main(["synth", str(tmp_path / "out")])


def test_evaluate_refuses_to_replace_its_json_without_force(tmp_path, capsys):
    """Before any checkpoint is loaded (the scoring may take hours), and the file is kept as it was."""
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"earlier": "results"}')
    assert main(["evaluate", str(tmp_path), "--json", str(metrics)]) == 2
    assert "already exists" in capsys.readouterr().err and metrics.read_text() == '{"earlier": "results"}'
    assert main(["evaluate", str(tmp_path), "--json", str(metrics), "--force"]) == 2  # past the check: no model
    assert "not a checkpoint" in capsys.readouterr().err


def test_an_unknown_option_is_reported_by_its_verb_with_the_closest_known_one(tmp_path, capsys):
    """`itmatch search INDEX q --shortlst 5` names the verb and its --help (not `itmatch --help`), and the option
    that was meant; an option with nothing close gets no guess."""
    evaluation, figure = str(tmp_path / "a.json"), str(tmp_path / "x.png")
    Path(evaluation).write_text("{}")
    for argv, said in ((["search", str(tmp_path), "q", "--shortlst", "5"], "did you mean --shortlist?"),
                       (["models", "--top", "5"], "unrecognized arguments: --top 5 (see `itmatch models --help`)"),
                       (["analyze", "recall", evaluation, "--out", figure, "--lables", "a"], "did you mean --labels?")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert said in err and err.startswith(f"itmatch {argv[0]}") and err.count("\n") == 1


@pytest.mark.parametrize(("argv", "command", "said"), [
    (["train", "--preset", "vsepp", "--data", ".", "--out", "RUN"], "_cmd_train", "the same command with --resume"),
    (["train", "--out", "RUN", "--resume"], "_cmd_train", "the same command continues from its last save"),
    (["extract", ".", "README.md", "--out", "FEATURES"], "_cmd_extract", "the same command continues where it"),
    (["evaluate", ".", "--resume-dir", "BLOCKS"], "_cmd_evaluate", "from the finished blocks in --resume-dir"),
    (["evaluate", "."], "_cmd_evaluate", None),
])
def test_an_interrupted_verb_says_how_to_continue_its_work(monkeypatch, capsys, argv, command, said):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(f"itmatch.cli.{command}", interrupted)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"itmatch {argv[0]}: interrupted") and (said in err if said else err.count(";") == 0)
