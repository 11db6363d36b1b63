"""User-facing errors: what is wrong, where (file and line), and how to fix it."""

from __future__ import annotations

from pathlib import Path


class ItmatchError(Exception):
    """An error caused by the user's input; the CLI prints it without a traceback."""

    def __init__(self, message: str, *, path: str | Path | None = None, line: int | None = None,
                 hint: str | None = None) -> None:
        self.message, self.path, self.line, self.hint = message, path, line, hint
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.path is not None:
            where = f"{self.path}:{self.line}: " if self.line is not None else f"{self.path}: "
        text = f"{where}{self.message}"
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text


class DataError(ItmatchError):
    """Malformed dataset, caption file, image or feature array."""


class ConfigError(ItmatchError):
    """Unknown model name, unknown config key, or an invalid value."""


class CheckpointError(ItmatchError):
    """Missing, corrupt or mismatched checkpoint."""


class OverwriteError(ItmatchError):
    """The output exists and --force was not given."""


class TrainingError(ItmatchError):
    """Training cannot go on: its loss stopped being a number (diverged)."""


class TrainingStopped(Exception):
    """A training ended on a stop signal (SIGINT or SIGTERM) after saving where it was (engine/stop.py): not an
    error, so not an ItmatchError; the CLI exits with 128 + the signal's number, as the signal would have."""

    def __init__(self, message: str, signum: int, resume: str = "") -> None:
        self.message, self.signum, self.resume = message, signum, resume
        super().__init__(message, signum, resume)  # (all in args: it pickles, as an exception must)

    def __str__(self) -> str:
        return f"{self.message}: `{self.resume}` continues from there" if self.resume else self.message


class UnknownWordsWarning(UserWarning):
    """A query has words the model's vocabulary does not know (read as <unk>; their meaning is lost)."""


def refuse_overwrite(path: str | Path, force: bool) -> None:
    """Raise unless `path` is absent or the user passed --force."""
    p = Path(path)
    if p.exists() and not force:
        raise OverwriteError("already exists", path=p,
                             hint="choose another output path or pass --force to replace it")


def whole_number(name: str, value: object, hint: str) -> int:
    """`value` of a Python argument that counts something (a batch size, top_k) as an int >= 1 (numpy integers
    taken; bools and floats refused), else a ConfigError naming the argument, with `hint`."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}", hint=hint)
    return int(value)
