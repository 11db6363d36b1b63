"""A training asked to stop (Ctrl-C, or SIGTERM from a job scheduler or `kill PID`) saves where it is first.

Without this, a signal ended the process at once and the run lost everything since its last checkpoint: up to an
epoch with the default `train.checkpoint_every=0` (45 minutes of a SCAN epoch on two CPU cores). With it, the first
SIGINT or SIGTERM only asks: the loop finishes the step it is in (a step half done would leave weights and optimizer
state that match no step), saves `last/` at that batch (the mid-epoch save that `--resume` continues from exactly)
and ends with `TrainingStopped`. A validation, which changes nothing and is run again on resuming, is cut short
instead (`StopRequest.interruptible`), so the wait is at most a step and a save. A second signal acts as it would
have without this (SIGINT raises KeyboardInterrupt, SIGTERM ends the process), for a user who cannot wait.

Under torchrun the ranks must stop at the same step: each rank's save of `last/` is a collective, and a rank that
stopped while the others trained on would leave them waiting in their next all-reduce until the timeout. A signal
there may reach one rank (`kill PID` of a worker) or all of them (torchrun's agent passes the signal it gets on to
every worker, once: torch >= 2.2 starts the workers in their own session, out of reach of a terminal's Ctrl-C). So
the request is `shared` there: each rank votes in the all-reduce it does every step anyway (`agree`), and all stop
at the first step where any rank was asked; a validation, sharded and full of collectives, is not cut short.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from itmatch import distributed as dist

#: the signals that ask a training to stop
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(Exception):
    """Raised where the stop signal found the training (inside `StopRequest.interruptible`), to save and end."""


class StopRequest:
    """Which stop signal arrived first (None: none yet); the training loop reads it between steps. `shared` (under
    torchrun): the ranks' agreed request instead, settled by `agree`, so that every rank reads the same."""

    def __init__(self, shared: bool = False) -> None:
        self.signal: int | None = None  # the first stop signal this process received
        self.shared = shared
        self._agreed: int | None = None
        self._interruptible = False

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Work that may be cut short by the request (StopNow raised where it is): nothing it does outlives it.
        Shared, nothing is cut short: the ranks would be cut at different collectives."""
        if self.shared:
            yield
            return
        if self.requested:
            raise StopNow
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def agree(self, *means: float) -> list[float]:
        """`means` averaged over the ranks, in the one all-reduce that also settles the request: stop if any rank
        was asked, for the first of STOP_SIGNALS that any rank received (the same answer on every rank). In one
        process, `means` as they are, and the request is this process's own."""
        if not self.shared:
            return list(means)
        votes = [float(self.signal == sig) for sig in STOP_SIGNALS]
        sums = dist.sum_over_ranks([*means, *votes])
        if self._agreed is None:
            self._agreed = next((sig for sig, n in zip(STOP_SIGNALS, sums[len(means):], strict=True) if n > 0), None)
        return [total / dist.world_size() for total in sums[:len(means)]]

    @property
    def decided(self) -> int | None:
        """The stop signal the training acts on: this process's, or shared, the ranks' agreed one."""
        return self._agreed if self.shared else self.signal

    @property
    def requested(self) -> bool:
        return self.decided is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.decided).name if self.decided is not None else ""


#: the stop signal a training process (`start_training_process`) received, within a training or between two: every
#: training it starts later starts asked to stop, so that it saves and ends at its first step instead of training on
_training_process_stop = StopRequest()
_in_training_process = False


@contextlib.contextmanager
def stop_on_signal(enabled: bool = True, announce: bool = True, *, shared: bool = False,
                   on_signal: Callable[[int, bool], None] | None = None,
                   what: str = "the training saves where it is, then stops") -> Iterator[StopRequest]:
    """Catch SIGINT and SIGTERM while the block runs (the handlers are put back after it). Off where a signal
    handler cannot be set (not the main thread) or when not `enabled`: the request then never comes and the signals
    act as they always did. `shared`: the ranks of a torchrun group agree on the request (`StopRequest.agree`).
    `announce`: say on stderr, at the first signal, what happens now (`what`). A signal ignored when the block begins
    stays ignored: a shell starts a background job (`itmatch train ... &`) with SIGINT ignored so that a Ctrl-C meant
    for the foreground leaves it alone, and Python itself keeps such a SIGINT ignored. `on_signal(signum, first)` is
    called at each signal before it is acted on (a parent passes it on to the processes that train for it:
    `pass_stop_on`)."""
    request = StopRequest(shared)
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield request
        return
    request.signal = _training_process_stop.signal  # (None but in a training process asked to stop)
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def handler(signum: int, frame: FrameType | None) -> None:
        if on_signal is not None:
            on_signal(signum, request.signal is None)
        if _in_training_process:
            _remember_stop(signum, frame)
        if request.signal is None:
            request.signal = signum
            if announce:
                print(f"\nitmatch: {signal.Signals(signum).name}: {what} (send it again to stop at once, without "
                      "saving)", file=sys.stderr, flush=True)
            if request._interruptible:
                raise StopNow
            return
        # the second one: what it would have done without this handler
        signal.signal(signum, previous[signum])
        if signum == signal.SIGINT and previous[signum] is signal.default_int_handler:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)

    for sig in STOP_SIGNALS:
        if previous[sig] is not signal.SIG_IGN:
            signal.signal(sig, handler)
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's start (`worker_init_fn`): the main process decides when to stop. A Ctrl-C reaches
    the terminal's whole process group, and a worker that died of it would fail the batch the main process fetches
    before its save; the workers end when the main process shuts its loader down, or when it is gone."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def start_training_process() -> None:
    """The start (`initializer`) of a pool process that trains for a parent holding `stop_on_signal` with
    `pass_stop_on`: the parent decides when its trainings stop. A terminal's Ctrl-C, which reaches the whole process
    group, is ignored here (the parent passes it on as SIGTERM). A SIGTERM is kept (`_training_process_stop`), so that a
    training the pool had already queued to this process starts asked to stop (it saves at its first step); one that
    comes between two trainings does not end the process, which would break the pool and have it kill the other
    trainings mid-save."""
    global _in_training_process
    _in_training_process = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _remember_stop)


def _remember_stop(signum: int, frame: FrameType | None) -> None:
    _training_process_stop.signal = _training_process_stop.signal or signum


def pass_stop_on(signum: int, first: bool) -> None:
    """`on_signal` of a parent whose trainings run in its child processes (started with `start_training_process`):
    the first stop signal asks each to save where it is and stop (SIGTERM), the second stops them at once
    (SIGKILL), as the two signals do to a training in this process."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM if first else signal.SIGKILL)
