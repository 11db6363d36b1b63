"""scripts/device_session.py: what a lent GPU machine receives call by call comes out whole on the other side."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def session(tmp_path, monkeypatch):
    module = load_script("scripts/device_session.py")
    monkeypatch.setattr(module, "DEVICE_ROOT", tmp_path / "device")
    # (the bench's check of the rows runs the bench, seconds a call: tested on its own below)
    monkeypatch.setattr(module, "check_items", lambda args: None)
    return module


def test_bundles_stay_within_budget_and_rejoin_large_files_byte_for_byte(session, tmp_path, monkeypatch):
    monkeypatch.setattr(session, "FILE_OVERHEAD", 0)  # bytes alone here; the overhead has its own test
    source = tmp_path / "here"
    source.mkdir()
    sizes = {"whl/big.whl": 2500, "whl/small.whl": 300, "shared/a.txt": 0, "shared/images/p1.jpg": 999,
             "shared/images/p2.jpg": 1000, "whl/exact.whl": 2000}
    files = []
    for i, (dest, size) in enumerate(sizes.items()):
        path = source / f"f{i}"
        path.write_bytes(os.urandom(size))
        files.append((path, dest))
    budget = 1000
    bundles = session.plan_bundles(files, budget)
    assert all(sum(length for *_, length in pieces) <= budget for pieces in bundles)
    # big: 1000, 1000, 500 (+ small + a.txt beside its last piece); p1; p2; exact: 1000, 1000
    assert len(bundles) == 7
    for i, pieces in enumerate(bundles, 1):
        session.write_bundle(tmp_path / "carry" / f"{i:02d}", pieces)
    received = tmp_path / "device"
    for i in range(1, len(bundles) + 1):  # in order, one call each
        session.unpack(tmp_path / "carry" / f"{i:02d}", received)
    for (path, dest) in files:
        assert (received / dest).read_bytes() == path.read_bytes(), dest
    assert not [p for p in received.rglob("*") if session.CHUNK in p.name]  # every piece joined and removed


def test_a_file_is_joined_only_when_all_its_pieces_have_arrived(session, tmp_path):
    first, second = tmp_path / f"m.whl{session.CHUNK}1-of-2", tmp_path / f"m.whl{session.CHUNK}2-of-2"
    first.write_bytes(b"abc")
    session._join_if_complete(first)
    assert not (tmp_path / "m.whl").exists() and first.exists()  # the second call has not come yet
    second.write_bytes(b"def")
    session._join_if_complete(second)
    assert (tmp_path / "m.whl").read_bytes() == b"abcdef" and not first.exists() and not second.exists()


def test_poll_reports_each_rows_epochs_and_knows_when_all_are_done(session, tmp_path):
    logs = tmp_path / "device" / "logs"
    logs.mkdir(parents=True)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 3.0}\n{"epoch": 1, "val_rsum": 101.25}\n{"epoch": 2, "val_rsum": 150.0}\n')
    assert session._epochs(metrics) == "1: 101.2, 2: 150.0"
    assert session._epochs(tmp_path / "absent.jsonl") == "no epoch yet"
    (logs / "driver.log").write_text("vsepp: exit 0 after 300 s\n")
    assert not session._all_done(logs, ["vsepp", "scan_i2t_lse"])
    (logs / "driver.log").write_text("vsepp: exit 0 after 300 s\nscan_i2t_lse: exit 1 after 400 s\n")
    assert session._all_done(logs, ["vsepp", "scan_i2t_lse"])


def test_each_file_counts_its_overhead_against_a_calls_budget(session, tmp_path, monkeypatch):
    """The tool counts more than the bytes (a 42.6 MB bundle of 4,872 photos was refused beside a 19.7 MiB
    checkout): three 500-byte files with 100 bytes each of overhead fill a 1200-byte budget two at a time."""
    monkeypatch.setattr(session, "FILE_OVERHEAD", 100)
    files = []
    for i in range(3):
        (tmp_path / f"p{i}").write_bytes(os.urandom(500))
        files.append((tmp_path / f"p{i}", f"images/p{i}.jpg"))
    assert [len(pieces) for pieces in session.plan_bundles(files, 1200)] == [2, 1]
    (tmp_path / "big").write_bytes(os.urandom(2500))  # pieces leave room for their own overhead
    pieces = session.plan_bundles([(tmp_path / "big", "whl/big.whl")], 1200)
    assert all(length + 100 <= 1200 for bundle in pieces for *_, length in bundle)


def test_the_features_are_extracted_once_by_the_drivers_started_side_by_side(session, tmp_path, monkeypatch):
    """A second `start` adds rows while the first driver extracts: its driver waits for that extraction instead of
    running another one into the same folder."""
    logs = tmp_path / "device" / "logs"
    logs.mkdir(parents=True)
    extractions = []

    def extract(*args, **kwargs):
        extractions.append(args)
        time.sleep(0.3)  # long enough for the second driver to arrive while the first extracts

    monkeypatch.setattr(session.subprocess, "run", extract)
    drivers = [threading.Thread(target=session.extract_once, args=(logs, tmp_path)) for _ in range(2)]
    for driver in drivers:
        driver.start()
    for driver in drivers:
        driver.join(10)
    session.extract_once(logs, tmp_path)  # a driver started after it finished
    assert len(extractions) == 1 and (logs / "extract.done").exists()
    assert re.search(r"\[extract: done in \d+ s on \d+ host cores\]\n$", (logs / "extract.log").read_text())
    (logs / "extract.done").unlink()
    session.extract_once(logs, tmp_path, dry_run=True)  # a rehearsal here: the command, not a real extraction
    assert len(extractions) == 1 and not (logs / "extract.done").exists()
    assert (logs / "extract.log").read_text().endswith("--out runs/data/flickr8k_lite0 --batch-size 128\n")


def test_a_later_start_adds_its_rows_to_what_poll_waits_for(session, tmp_path, monkeypatch):
    (tmp_path / "device" / "itmatch").mkdir(parents=True)  # the working copy is there already
    started = []
    monkeypatch.setattr(session.subprocess, "Popen", lambda argv, **kwargs: started.append(json.loads(argv[-1])))
    main = session.main
    main(["start", "--row", "scan_t2i_avg", "--row", "scan_i2t_lse", "--parallel", "2"])
    first = json.loads((tmp_path / "device" / "logs" / "plan.json").read_text())
    main(["start", "--row", "oan"])
    plan = json.loads((tmp_path / "device" / "logs" / "plan.json").read_text())
    assert plan == {"rows": ["scan_t2i_avg", "scan_i2t_lse", "oan"], "started": first["started"]}
    assert [driver["rows"] for driver in started] == [["scan_t2i_avg", "scan_i2t_lse"], ["oan"]]
    assert [driver["parallel"] for driver in started] == [2, 6]


def test_a_perturbation_study_takes_seven_training_slots_and_poll_brings_back_its_table(session, tmp_path,
                                                                                       monkeypatch):
    """`--perturb scan_t2i_avg` is one plan item that trains seven models: with --parallel 8 it starts beside one
    row, the next row waits until a slot frees; poll counts each training's epochs and copies the study's table."""
    device = tmp_path / "device"
    (device / "itmatch").mkdir(parents=True)
    drivers = []
    monkeypatch.setattr(session.subprocess, "Popen", lambda argv, **kwargs: drivers.append(argv[-1]))
    session.main(["start", "--perturb", "scan_t2i_avg", "--row", "oan", "--row", "vsepp", "--parallel", "8"])
    plan = json.loads((device / "logs" / "plan.json").read_text())
    assert plan["rows"] == ["oan", "vsepp", "perturb:scan_t2i_avg"]
    assert session.bench_item("perturb:scan_t2i_avg", 8) == (["--perturb", "scan_t2i_avg", "--jobs", "7"], 7)
    assert session.bench_item("perturb:vsepp", 4) == (["--perturb", "vsepp", "--jobs", "4"], 4)
    assert session.bench_item("oan", 8) == (["--row", "oan"], 1)

    launched, finished = [], set()

    class Training:  # a bench process that ends once the test says so
        def __init__(self, argv, **kwargs):
            self.item, self.returncode = argv[argv.index("--config") + 2:][1], 0
            launched.append((argv[argv.index("--config") + 2:], len(launched) - len(finished)))

        def poll(self):
            return 0 if self.item in finished else None

    def sleep(_):  # each pause of the driver lets the earliest running item finish
        running = [args[1] for args, _ in launched if args[1] not in finished]
        finished.add(running[0])

    monkeypatch.setattr(session.subprocess, "Popen", Training)
    monkeypatch.setattr(session, "extract_once", lambda logs, work, dry_run=False: None)
    monkeypatch.setattr(session.time, "sleep", sleep)
    session.run_rows(type("Args", (), {"driver": drivers[0]})())
    # oan (1) + vsepp (1) run; the study (7) waits until only one training is left, then starts beside it
    assert [(args[:2], busy) for args, busy in launched] == [
        (["--row", "oan"], 0), (["--row", "vsepp"], 1), (["--perturb", "scan_t2i_avg"], 1)]

    study = device / "itmatch" / "runs" / "flickr8k_gpu" / "perturb" / "scan_t2i_avg"
    for kind, epochs in (("original", 3), ("nouns", 1)):
        (study / kind).mkdir(parents=True)
        (study / kind / "metrics.jsonl").write_text('{"epoch": 1, "val_rsum": 100.0}\n' * epochs)
    table = device / "itmatch" / "docs" / "results" / "perturb" / "flickr8k_gpu_scan_t2i_avg.csv"
    table.parent.mkdir(parents=True)
    table.write_text("perturbation,r1\n")
    (device / "logs" / "driver.log").write_text("oan: exit 0\nvsepp: exit 0\nperturb:scan_t2i_avg: exit 0\n")
    evaluation = device / "itmatch" / "runs" / "flickr8k_gpu" / "oan.test.json"
    evaluation.write_text('{"rsum": 261.2, "recall_curve": {}}')
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert session.main(["poll", "--wait", "0"]) == 0
    assert "== perturb:scan_t2i_avg: nouns 1 epochs, original 3 epochs" in (tmp_path / "out" / "poll.txt").read_text()
    # what comes back is within a call's limits: at most 8 files, named in letters, digits, '.', '_' and '-'
    returned = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert returned == ["poll.txt", session.POLLED] and all(re.fullmatch(r"[\w.-]+", n) for n in returned)
    here = tmp_path / "checkout"
    assert session.main(["take", str(tmp_path / "out"), "--checkout", str(here), "--runs", str(tmp_path / "r")]) == 0
    assert (here / "runs" / "flickr8k_gpu" / "oan.test.json").read_text() == evaluation.read_text()
    assert not (here / "runs" / "flickr8k_gpu" / "vsepp.test.json").exists()  # (not evaluated yet)
    assert (here / "docs" / "results" / "perturb" / "flickr8k_gpu_scan_t2i_avg.csv").read_text() == table.read_text()
    # each poll packs every file done so far: taking it again leaves what is there, and refuses only what differs
    assert session.main(["take", str(tmp_path / "out"), "--checkout", str(here), "--runs", str(tmp_path / "r")]) == 0
    (here / "runs" / "flickr8k_gpu" / "oan.test.json").write_text('{"rsum": 1.0}')
    assert session.main(["take", str(tmp_path / "out"), "--checkout", str(here), "--runs", str(tmp_path / "r")]) == 1
    assert (here / "runs" / "flickr8k_gpu" / "oan.test.json").read_text() == '{"rsum": 1.0}'
    with pytest.raises(SystemExit):  # nothing to run is a usage error, not an empty driver
        session.main(["start", "--parallel", "2"])


def test_kickoff_times_the_benches_before_the_rows_start_and_tests_beside_them(session, tmp_path, monkeypatch):
    """The order that keeps the timings clean: both benches on the idle GPU, then the rows, then the tests; each
    bounded, and one that runs over its time is reported, not waited for."""
    monkeypatch.setattr(session, "ROOT", tmp_path / "checkout")
    (tmp_path / "checkout").mkdir()
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    events = []

    def run(argv, timeout, **kwargs):
        events.append(("run", argv[1] if argv[1] != "-m" else "pytest", timeout))
        if argv[1] == "-m":
            raise session.subprocess.TimeoutExpired(argv, timeout)
        return session.subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(session.subprocess, "run", run)
    monkeypatch.setattr(session.subprocess, "Popen", lambda argv, **kwargs: events.append(("start", argv[-1])))
    session.main(["kickoff", "--row", "scan_t2i_avg", "--parallel", "2"])
    assert [e[:2] for e in events] == [("run", "bench/gpu.py")] * 3 + [
        ("start", json.dumps({"rows": ["scan_t2i_avg"], "parallel": 2, "bench": []})), ("run", "pytest")]
    assert "[-m pytest: stopped after 170 s]" in (tmp_path / "out" / "cuda_tests.txt").read_text()
    assert "exit 0" in (tmp_path / "out" / "gpu_eval.txt").read_text()
    events.clear()  # an empty --train-presets leaves the training bench out (its minute goes to the rows)
    session.main(["kickoff", "--train-presets", "", "--row", "oan"])
    assert [e[2] for e in events if e[:2] == ("run", "bench/gpu.py")] == [150, 90]
    events.clear()  # --benches picks them: the block-cap sweep alone, or none
    session.main(["kickoff", "--benches", "blocks", "--row", "oan"])
    assert [e[2] for e in events if e[:2] == ("run", "bench/gpu.py")] == [90]
    events.clear()
    session.main(["kickoff", "--benches", "", "--perturb", "vsepp"])
    assert [e[0] for e in events] == ["start", "run"]


def test_a_row_or_study_the_bench_does_not_have_stops_start_and_kickoff_before_anything(tmp_path, monkeypatch):
    session = load_script("scripts/device_session.py")  # (with its check_items)
    monkeypatch.setattr(session, "DEVICE_ROOT", tmp_path / "device")
    for argv in (["start", "--row", "scan_t2i_avg", "--row", "scan_t2i_avgg"],
                 ["kickoff", "--perturb", "vsepp", "--row", "oan_lambda9"]):
        with pytest.raises(SystemExit, match="nothing started: .*unknown row.*(scan_t2i_avgg|oan_lambda9)"):
            session.main(argv)
    with pytest.raises(SystemExit, match="nothing started: .*invalid choice: 'sman'"):
        session.main(["start", "--perturb", "sman"])
    assert not (tmp_path / "device").exists()  # no working copy, no bench, no driver


def test_a_fetched_run_comes_back_whole_in_pieces_and_is_never_overwritten(session, tmp_path, monkeypatch):
    """`fetch` (there) cuts a trained run into pieces small enough for $OUT; `take` (here) joins them into the run
    directory the bench reads: best/ byte for byte, last/state.json (training finished), without the last epoch's
    weights and optimizer; an existing run directory is kept unless --force."""
    monkeypatch.setattr(session, "OUT_FILE_LIMIT", 4096)
    run = session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / "scan_i2t_lse"
    files = {"config.json": b'{"train": {"epochs": 30}}', "metrics.jsonl": b"{}\n", "best/config.json": b"{}",
             "best/model.safetensors": os.urandom(10_000), "last/state.json": b'{"epoch": 30}',
             "last/model.safetensors": os.urandom(5000), "last/optimizer.pt": os.urandom(5000)}
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    assert session.main(["fetch", "scan_i2t_lse"]) == 0
    pieces = sorted(out.iterdir())
    assert len(pieces) >= 3 and all(p.stat().st_size <= 4096 for p in pieces)
    assert session.main(["fetch", "oan"]) == 1  # not trained there: said, nothing written
    (run / "last" / "state.json").write_bytes(b'{"epoch": 12}')
    assert session.main(["fetch", "scan_i2t_lse"]) == 1  # epochs left: it could be resumed nowhere without last/
    assert sorted(out.iterdir()) == pieces
    (run / "last" / "state.json").write_bytes(files["last/state.json"])

    here = tmp_path / "runs"
    assert session.main(["take", str(out), "--runs", str(here)]) == 0
    got = here / "scan_i2t_lse"
    kept = {name for name in files if name not in session.FETCH_SKIPS}
    assert {p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()} == kept
    assert all((got / name).read_bytes() == files[name] for name in kept)

    (got / "best" / "model.safetensors").write_bytes(b"trained here")
    assert session.main(["take", str(out), "--runs", str(here)]) == 1  # refused: the run here stays
    assert (got / "best" / "model.safetensors").read_bytes() == b"trained here"
    assert session.main(["take", str(out), "--runs", str(here), "--force"]) == 0
    assert (got / "best" / "model.safetensors").read_bytes() == files["best/model.safetensors"]
    pieces[0].unlink()
    assert session.main(["take", str(out), "--runs", str(tmp_path / "elsewhere")]) == 1  # a piece missing: said


def test_a_trained_run_travels_there_as_fetch_brings_one_back(session, tmp_path):
    """`prepare --runs vsepp` carries a run trained here (its best checkpoint, config, history, last state; not the
    last epoch's weights and optimizer) to where the bench there looks, so vsepp_ft need not retrain vsepp."""
    run = tmp_path / "vsepp"
    for name in ["best/config.json", "best/model.safetensors", "config.json", "metrics.jsonl", "last/state.json",
                 "last/model.safetensors", "last/optimizer.pt", "last/trainer.pt"]:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    (run / "config.json").write_text('{"train": {"epochs": 30}}')
    (run / "last" / "state.json").write_text('{"epoch": 30, "batch": 0}')
    files = session.run_files("vsepp", tmp_path)
    assert sorted(dest for _, dest in files) == [f"itmatch/runs/flickr8k_gpu/vsepp/{name}" for name in [
        "best/config.json", "best/model.safetensors", "config.json", "last/state.json", "metrics.jsonl"]]
    assert all(source.read_text() == dest.split("vsepp/", 1)[1] for source, dest in files
               if not dest.endswith(("/config.json", "state.json")) or "best/" in dest)
    (run / "last" / "state.json").write_text('{"epoch": 30, "batch": 17}')  # stopped in its last epoch
    with pytest.raises(SystemExit, match="has epochs left to train"):
        session.run_files("vsepp", tmp_path)
    (run / "best" / "config.json").unlink()
    with pytest.raises(SystemExit, match="no trained run"):
        session.run_files("vsepp", tmp_path)


def test_a_studys_finished_run_travels_back_and_there_again_under_its_own_path(session, tmp_path, monkeypatch):
    """A perturbation study's run (`perturb/scan_t2i_avg/shuffle`) is fetched, taken and carried under its path in
    the study, so that a study split over two sessions reuses the first session's finished runs."""
    monkeypatch.setattr(session, "OUT_FILE_LIMIT", 4096)
    row = "perturb/scan_t2i_avg/shuffle"
    run = session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / row
    files = {"config.json": b'{"train": {"epochs": 30}}', "study.json": b"{}", "eval_test_1k.json": b"{}",
             "best/config.json": b"{}",
             "best/model.safetensors": os.urandom(6000), "last/state.json": b'{"epoch": 30}',
             "last/model.safetensors": os.urandom(5000)}
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    assert session.main(["fetch", row]) == 0
    assert all(p.name.startswith("perturb__scan_t2i_avg__shuffle.tar") for p in out.iterdir())

    here = tmp_path / "runs"
    assert session.main(["take", str(out), "--runs", str(here)]) == 0
    kept = {name for name in files if name != "last/model.safetensors"}
    assert {p.relative_to(here / row).as_posix() for p in (here / row).rglob("*") if p.is_file()} == kept
    assert all((here / row / name).read_bytes() == files[name] for name in kept)
    assert sorted(dest for _, dest in session.run_files(row, here)) == sorted(
        f"itmatch/runs/flickr8k_gpu/{row}/{name}" for name in kept)


def test_ship_takes_back_a_package_too_large_to_come_back_and_says_how_to_ship_it(session, tmp_path, monkeypatch,
                                                                                    capsys):
    """$OUT returns files of at most 16 MiB: a SCAN at D = 960 (18.8 MB of weights) would be left out there
    without a word, so `ship` removes it and names fetch / take / ship here; a package that fits stays."""
    monkeypatch.setattr(session, "OUT_FILE_MAX", 4096)
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    weights = {"small-flickr8k": 4096, "large-flickr8k": 4097}

    def ship_pretrained(cmd, **kwargs):  # what scripts/ship_pretrained.py writes into --out-root
        name = cmd[3]
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(os.urandom(weights[name]))
        (out / name / "card.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(session.subprocess, "run", ship_pretrained)
    assert session.main(["ship", "scan_i2t_lse", "small-flickr8k"]) == 0
    assert (out / "small-flickr8k" / "model.safetensors").stat().st_size == 4096  # (the most that comes back)
    assert session.main(["ship", "scan_i2t_lse_d960", "large-flickr8k"]) == 1
    assert not (out / "large-flickr8k").exists()
    said = capsys.readouterr().err
    assert "model.safetensors" in said and "`fetch scan_i2t_lse_d960`" in said
    assert "scripts/ship_pretrained.py runs/flickr8k_gpu/scan_i2t_lse_d960/best large-flickr8k" in said


def test_the_scripts_reading_of_a_finished_run_is_the_trainers(session, tmp_path):
    """run_finished reads a run without itmatch (the script runs on a bare machine): it must agree with
    itmatch.engine.train.training_finished."""
    from itmatch.engine.train import training_finished

    run = tmp_path / "run"
    cases = [(None, False, None), (None, True, None), ({"epoch": 30}, True, 30), ({"epoch": 29, "batch": 0}, True, 30),
             ({"epoch": 30, "batch": 5}, True, 30), ({"epoch": 31, "batch": 0}, False, 30)]
    for state, best, epochs in cases:
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        if best:
            (run / "best").mkdir()
        if state is not None:
            (run / "last").mkdir()
            (run / "last" / "state.json").write_text(json.dumps(state))
            (run / "config.json").write_text(json.dumps({"train": {"epochs": epochs}}))
        assert session.run_finished(run) == training_finished(run), (state, best, epochs)


def test_the_working_copy_has_the_checkouts_results_when_a_bundle_of_runs_came_first(session, tmp_path):
    """A bundle of runs or POS tags makes DEVICE_ROOT/itmatch before the first copy: the copy then left docs/results
    out (kept for rows written there), and a study's table had no folder to be written to."""
    (session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / "perturb" / "cache").mkdir(parents=True)
    session.work_copy()
    work = session.DEVICE_ROOT / "itmatch"
    assert (work / "docs" / "results" / "flickr8k_gpu.csv").read_text() == (
        ROOT / "docs" / "results" / "flickr8k_gpu.csv").read_text()
    (work / "docs" / "results" / "flickr8k_gpu.csv").write_text("rows written there\n")
    session.work_copy()  # (each later call: the rows written there stay)
    assert (work / "docs" / "results" / "flickr8k_gpu.csv").read_text() == "rows written there\n"
    assert not (work / ".git").exists() and (work / "src" / "itmatch" / "engine" / "results.py").is_file()
