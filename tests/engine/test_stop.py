"""A training asked to stop by SIGINT / SIGTERM saves where it is, and --resume ends where an uninterrupted run ends
(engine/stop.py; a SIGKILL, which cannot be caught, is test_faults.py's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from test_validation import QUICK, _log, _untimed

import itmatch
from itmatch.engine.stop import StopNow, stop_on_signal
from itmatch.engine.train import train
from itmatch.errors import TrainingStopped
from itmatch.models.registry import resolve_config

BATCH, BATCHES = QUICK["train"]["batch_size"], QUICK["train"]["max_batches"]


def _cfg(data: Path):
    # no periodic mid-epoch save: the stop's save is the only one inside an epoch
    return resolve_config("scan_t2i_avg", {**QUICK, "data": {"path": str(data)},
                                           "train": {**QUICK["train"], "checkpoint_every": 0}})


def signal_while_building(epoch: int, batch: int, signum: int = signal.SIGTERM):
    """A caption transform that sends `signum` to this process while batch `batch` (0-based) of epoch `epoch`
    (0-based) is built (workers=0: in the main process, just before that batch's step)."""
    at = (epoch * BATCHES + batch) * BATCH + 1
    calls = 0

    def transform(caption, j):
        nonlocal calls
        calls += 1
        if calls == at:
            os.kill(os.getpid(), signum)
        return caption

    return transform


def _weights(run: Path) -> dict:
    return load_file(str(run / "last" / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


class Unhandled(Exception):
    pass


@pytest.fixture
def sigterm_fails_the_test():
    """SIGTERM that the training does not catch fails the test instead of killing pytest."""
    def fail(signum, frame):
        raise Unhandled("SIGTERM reached the test: the training did not catch it")

    previous = signal.signal(signal.SIGTERM, fail)
    yield fail
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def reference(tiny_precomp, tmp_path_factory) -> tuple[dict, Path]:
    run = tmp_path_factory.mktemp("stop") / "reference"
    return train(_cfg(tiny_precomp), run, progress=False), run


@pytest.mark.parametrize("epoch, batch", [(1, 4), (0, BATCHES - 1)], ids=["mid-epoch", "an epoch's last batch"])
def test_a_stop_signal_saves_at_the_step_and_resume_ends_as_the_uninterrupted_run(tiny_precomp, tmp_path, reference,
                                                                                 epoch, batch, sigterm_fails_the_test):
    expected, ref_run = reference
    run = tmp_path / "run"
    with pytest.raises(TrainingStopped) as stopped:
        train(_cfg(tiny_precomp), run, progress=False, transform=signal_while_building(epoch, batch))
    assert stopped.value.signum == signal.SIGTERM
    assert f"stopped by SIGTERM at epoch {epoch + 1}, batch {batch + 1} of {BATCHES}" in stopped.value.message
    assert str(stopped.value).endswith(f"saved to {run / 'last'}: `itmatch train --out {run} --resume` continues "
                                       "from there")
    state = json.loads((run / "last" / "state.json").read_text())
    assert (state["epoch"], state["batch"]) == (epoch, batch + 1)  # the batch whose step ran is saved as done
    assert signal.getsignal(signal.SIGTERM) is sigterm_fails_the_test  # (put back)
    resumed = train(_cfg(tiny_precomp), run, resume=True, progress=False)
    assert _untimed(resumed) == _untimed(expected)
    assert _log(run) == _log(ref_run)
    assert _same_weights(_weights(run), _weights(ref_run))


def test_a_stop_in_a_validation_cuts_it_short_and_the_resumed_run_validates_that_epoch_again(
        tiny_precomp, tmp_path, reference, monkeypatch, sigterm_fails_the_test):
    import itmatch.engine.train as training

    expected, ref_run = reference
    real, calls = training.evaluate_models, []

    def evaluate_then_stop(*args, **kwargs):  # the signal comes while the first validation scores
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the validation went on after the stop signal")
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "evaluate_models", evaluate_then_stop)
    run = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM at epoch 1, in its validation"):
        train(_cfg(tiny_precomp), run, progress=False)
    state = json.loads((run / "last" / "state.json").read_text())
    assert (state["epoch"], state["batch"]) == (0, BATCHES)
    assert not (run / "best").exists()
    monkeypatch.setattr(training, "evaluate_models", real)
    resumed = train(_cfg(tiny_precomp), run, resume=True, progress=False)
    assert _untimed(resumed) == _untimed(expected) and _log(run) == _log(ref_run)
    assert _same_weights(_weights(run), _weights(ref_run))


@pytest.fixture
def sigint_as_python_sets_it():
    """SIGINT raising KeyboardInterrupt, as Python sets it at start unless SIGINT is ignored then (a background
    job of a shell: CI started with `&` runs this suite so)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_signal_asks_the_second_acts_and_the_handlers_are_put_back(sigterm_fails_the_test,
                                                                             sigint_as_python_sets_it):
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signal(announce=False) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # a user who cannot wait for the save
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is sigterm_fails_the_test
    with stop_on_signal(announce=False) as stop:  # SIGTERM's second: the handler before it
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Unhandled):
            os.kill(os.getpid(), signal.SIGTERM)
    with stop_on_signal(announce=False) as stop:  # interruptible work is cut where the signal finds it
        with pytest.raises(StopNow), stop.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("not cut short")
        with pytest.raises(StopNow), stop.interruptible():  # (asked before it began: it does not begin)
            raise AssertionError("began")
    with stop_on_signal(enabled=False) as stop, pytest.raises(KeyboardInterrupt):  # (torchrun: as before)
        os.kill(os.getpid(), signal.SIGINT)
    assert not stop.requested


def test_a_signal_ignored_before_stays_ignored(sigterm_fails_the_test):
    """A background job's SIGINT (ignored by its shell) neither stops the training nor raises."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_signal(announce=False) as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)  # (SIGTERM is still caught)
            assert stop.requested and stop.name == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def _training_process_stand_in(ready) -> None:
    """A pool process that trains for its parent (`start_training_process`), as long as nobody asks it to stop: it
    then ends on its own (exit 7), as a training saves and ends."""
    import sys
    import time

    from itmatch.engine import stop

    stop.start_training_process()
    ready.set()
    os.kill(os.getpid(), signal.SIGINT)  # (a terminal's Ctrl-C: ignored, the parent passes stops on)
    while stop._training_process_stop.signal is None:
        time.sleep(0.01)
    with stop_on_signal(announce=False) as request:  # a training it starts now starts asked to stop
        sys.exit(7 if request.requested and request.name == "SIGTERM" else 3)


@pytest.mark.parametrize("first", [True, False], ids=["the first signal asks", "the second stops at once"])
def test_a_parent_passes_a_stop_on_to_its_training_processes(first):
    import multiprocessing

    from itmatch.engine.stop import pass_stop_on

    context = multiprocessing.get_context("fork")
    children = [(context.Process(target=_training_process_stand_in, args=(ready,)), ready)
                for ready in (context.Event(), context.Event())]
    for child, ready in children:
        child.start()
        assert ready.wait(30)
    time.sleep(0.2)  # (each past its ignored SIGINT and waiting to be asked)
    assert all(child.is_alive() for child, _ in children)
    pass_stop_on(signal.SIGTERM, first)
    for child, _ in children:
        child.join(30)
    assert [child.exitcode for child, _ in children] == ([7, 7] if first else [-signal.SIGKILL] * 2)


@pytest.mark.slow
def test_kill_of_the_cli_saves_says_how_to_resume_and_exits_as_the_signal_would(tiny_precomp, tmp_path, reference):
    """`kill PID` (SIGTERM) of a real `itmatch train` process, at whatever step it has reached."""
    expected, ref_run = reference
    run = tmp_path / "run"
    argv = ["train", "--preset", "scan_t2i_avg", "--data", str(tiny_precomp), "--out", str(run)]
    for key, value in [*[("model." + k, v) for k, v in QUICK["model"].items()], ("loss.warmup_epochs", 1),
                       *[("train." + k, v) for k, v in QUICK["train"].items() if k != "checkpoint_every"],
                       ("train.checkpoint_every", 0)]:
        argv += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(Path(itmatch.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "itmatch", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    log = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:  # training, past its first steps
        if log.exists() and sum('"step"' in line for line in log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "itmatch train: stopped by SIGTERM at epoch " in err, err[-3000:]
    assert f"; saved to {run / 'last'}; the same command with --resume continues from there" in err, err[-3000:]
    assert "Traceback" not in err
    state = json.loads((run / "last" / "state.json").read_text())
    assert state["step"] >= 3
    resumed = train(_cfg(tiny_precomp), run, resume=True, progress=False)
    assert _untimed(resumed) == _untimed(expected) and _log(run) == _log(ref_run)
    assert _same_weights(_weights(run), _weights(ref_run))
