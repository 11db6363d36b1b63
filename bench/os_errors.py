"""Probe: every verb that writes, pointed at a place the operating system refuses mid-command.

Outputs go under /proc (the argument checks pass: it exists and root may write by its permission bits, but
the kernel creates nothing there) and standard output goes to /dev/full (every write: "No space left on
device"). Each case must end in one `itmatch VERB: error: ...` line, exit code 1 or 2, no traceback (or
finish, exit 0, where the command had no need to write there)
(docs/reliability.md row 23). Linux only; about 8 s on 2 cores (a tiny dataset and model are made first).

    python bench/os_errors.py
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import traceback
from pathlib import Path

from itmatch.cli import main

PROC = "/proc/itmatch-probe"


def _setup(root: Path) -> dict[str, str]:
    """A tiny precomp dataset, a VSE++ checkpoint trained for one batch, an index folder of two photos."""
    import numpy as np
    from PIL import Image

    from itmatch.data.precomp import write_captions, write_features
    from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
    from itmatch.engine.train import train
    from itmatch.models.registry import build_model, resolve_config

    rng = np.random.default_rng(0)
    data = root / "precomp"
    for split, n in (("train", 40), ("dev", 10), ("test", 10)):
        write_features(data, split, rng.standard_normal((n, 4, 16)).astype(np.float32))
        write_captions(data, split, [f"{split}{i}" for i in range(n)], ["a red dog runs"] * (5 * n))
    cfg = resolve_config("vsepp", {"model": {"embed_size": 8, "word_dim": 8}, "data": {"path": str(data)},
                                   "train": {"epochs": 1, "batch_size": 16, "max_batches": 1, "val_images": 10}})
    train(cfg, root / "run", progress=False)
    # a model of the photo backbone's feature size (Lite0: 1280), untrained, for the index
    photo_cfg = resolve_config("vsepp", {"model": {"embed_size": 8, "word_dim": 8, "img_dim": 1280,
                                                   "vocab_size": len(load_checkpoint(root / "run" / "best").vocab)}})
    save_checkpoint(root / "photo_model", build_model(photo_cfg.model), photo_cfg,
                    load_checkpoint(root / "run" / "best").vocab)
    photos = root / "photos"
    photos.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (60 * i, 90, 120)).save(photos / f"p{i}.png")
    captions = root / "captions.csv"
    captions.write_text("image,caption,split\n" + "".join(f"p{i}.png,a red dog {k},train\n" for i in range(2)
                                                           for k in range(5)))
    return {"data": str(data), "ckpt": str(root / "run" / "best"), "photo_ckpt": str(root / "photo_model"),
            "photos": str(photos),
            "captions": str(captions)}


def _cases(p: dict[str, str]) -> list[tuple[str, list[str], bool]]:
    """(name, argv, stdout to /dev/full)."""
    return [
        ("synth OUT", ["synth", f"{PROC}/synth", "--train", "2", "--dev", "1", "--test", "1"], False),
        ("extract --out", ["extract", p["photos"], p["captions"], "--out", f"{PROC}/precomp", "--device", "cpu"],
         False),
        ("train --out", ["train", "--preset", "vsepp", "--data", p["data"], "--out", f"{PROC}/run",
                         "--set", "train.max_batches=1", "--device", "cpu"], False),
        ("evaluate --json", ["evaluate", p["ckpt"], "--quiet", "--device", "cpu", "--json", f"{PROC}/m.json"],
         False),
        ("evaluate --results", ["evaluate", p["ckpt"], "--quiet", "--device", "cpu", "--results",
                                f"{PROC}/r.csv"], False),
        ("evaluate --resume-dir", ["evaluate", p["ckpt"], "--quiet", "--device", "cpu", "--resume-dir",
                                   f"{PROC}/blocks"], False),
        ("analyze perturb --out", ["analyze", "perturb", "--preset", "vsepp", "--data", p["data"], "--out",
                                   f"{PROC}/study", "--perturbations", "original", "--device", "cpu"], False),
        ("demo --out", ["demo", "--out", f"{PROC}/demo", "--device", "cpu"], False),
        ("index --out", ["index", p["photos"], "--model", p["photo_ckpt"], "--out", f"{PROC}/index", "--device",
                         "cpu", "--quiet"], False),
        ("models > /dev/full", ["models"], True),
        ("evaluate > /dev/full", ["evaluate", p["ckpt"], "--quiet", "--device", "cpu"], True),
    ]


def _probe(argv: list[str], full_stdout: bool) -> tuple[int | str, str]:
    err = io.StringIO()
    full = open("/dev/full", "w", buffering=1) if full_stdout else None  # noqa: SIM115
    saved = sys.stdout
    try:
        if full is not None:
            sys.stdout = full
        with contextlib.redirect_stderr(err):
            code: int | str = main(argv)
    except BaseException as exc:  # noqa: BLE001 (what the probe looks for: anything that escaped main)
        code = f"raised {type(exc).__name__}"
        err.write(traceback.format_exc())
    finally:
        sys.stdout = saved
        if full is not None:
            with contextlib.suppress(OSError):
                full.close()
    return code, err.getvalue()


def run() -> int:
    if not Path("/proc/self").is_dir() or not Path("/dev/full").exists():
        print("needs Linux /proc and /dev/full", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        paths = _setup(Path(tmp))
        failures = 0
        print("| case | exit | message |\n|---|---|---|")
        for name, argv, full in _cases(paths):
            code, err = _probe(argv, full)
            lines = [x for x in err.splitlines() if x.startswith("itmatch ")]
            # (exit 0: the command finished without writing there, e.g. a one-block matrix keeps no block)
            ok = "Traceback" not in err and (code == 0 and not lines or code in (1, 2) and len(lines) == 1)
            failures += not ok
            shown = lines[-1] if lines else err.strip().splitlines()[-1] if err.strip() else ""
            print(f"| {name} | {code} | {'' if ok else 'FAIL: '}{shown[:150]} |")
    print(f"{failures} of {len(_cases(paths))} cases ended otherwise than in one error line")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run())
