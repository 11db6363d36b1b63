"""Fault injection: training and extraction run in a subprocess, are killed with SIGKILL at random
moments, resumed with the same command, and must end exactly where an uninterrupted run ends.

The kill moments are drawn from a seeded RNG (printed on failure); `ITMATCH_FAULT_SEED` picks another
seed, `ITMATCH_FAULT_KILLS` more kills (docs/reliability.md reports runs with both)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

import itmatch

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("ITMATCH_FAULT_SEED", "0"))
KILLS = int(os.environ.get("ITMATCH_FAULT_KILLS", "3"))
SRC = str(Path(itmatch.__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def _run(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _reference(code: str, started: Path) -> tuple[float, float]:
    """Run `code` uninterrupted; return (seconds until `started` appeared, seconds of work after it)."""
    t0 = time.monotonic()
    proc = _run(code)
    t_started = None
    while proc.poll() is None:
        if t_started is None and started.exists():
            t_started = time.monotonic()
        time.sleep(0.02)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    end = time.monotonic()
    t_started = t_started or end
    return t_started - t0, end - t_started


def _kill_and_resume(code: str, started: Path, rng: random.Random, startup: float, work: float,
                     budget: float = 900) -> list[str]:
    """Run `code` until it exits 0, killing it (SIGKILL) up to KILLS times: a kill lands at a random moment
    of the job's work (after `started` appears; the window shrinks as resumed runs have less left to do),
    or, one time in four, at a random moment from process start (imports, setup). Returns a description
    of each kill that landed; the caller checks at least one did."""
    faults: list[str] = []
    deadline = time.monotonic() + budget
    attempts = 0
    while True:
        proc = _run(code)
        if attempts < KILLS:
            attempts += 1
            early = rng.random() < 0.25
            t0 = time.monotonic()
            if early:
                delay = rng.uniform(0.0, startup + 0.5 * work)
            else:
                while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                t0 = time.monotonic()
                delay = rng.uniform(0.0, 0.9 * work * 0.7 ** len(faults))
            while proc.poll() is None and time.monotonic() - t0 < delay:
                time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                faults.append(f"kill {len(faults) + 1} at +{delay:.2f}s ({'from start' if early else 'in the job'})")
                continue
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, f"faults {faults}: the resumed run failed:\n{err[-3000:]}"
        return faults


TRAIN_SETS = ["model.embed_size=32", "model.word_dim=16", "train.epochs=2", "train.batch_size=32",
              "train.val_images=40", "train.lr=0.002", "loss.warmup_epochs=1", "train.checkpoint_every=3",
              "train.threads=1", "train.log_every=1"]


def _train_code(data: Path, out: Path) -> str:
    argv = ["train", "--preset", "scan_t2i_avg", "--data", str(data), "--out", str(out)]
    for s in TRAIN_SETS:
        argv += ["--set", s]
    # The run is started the way a user (or a job scheduler) would: the first time plainly, afterwards
    # always with --resume, which continues from `last` or restarts from the saved config.
    fresh = repr(argv)
    again = repr(argv + ["--resume"])
    return ("import sys, pathlib; from itmatch.cli import main; "
            f"out = pathlib.Path({str(out)!r}); "
            f"sys.exit(main({again} if (out / 'config.json').exists() else {fresh}))")


def _untimed(obj):
    """The same record without wall-clock fields (the only thing allowed to differ)."""
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if not k.endswith("_seconds")}
    return obj


def _run_summary(run: Path) -> dict:
    lines = [_untimed(json.loads(x)) for x in (run / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(run / "last" / "model.safetensors"))
    best = json.loads((run / "best" / "state.json").read_text())
    return {"log": lines, "weights": weights, "best_rsum": best["best_rsum"], "best": _untimed(best["best_result"])}


def test_training_killed_at_random_points_resumes_to_identical_metrics(tiny_precomp, tmp_path):
    rng = random.Random(SEED)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    startup, work = _reference(_train_code(tiny_precomp, ref_dir), ref_dir / "config.json")
    faults = _kill_and_resume(_train_code(tiny_precomp, run_dir), run_dir / "config.json", rng,
                              startup, work)
    assert faults, "no kill landed: the job finished before every kill moment"
    a, b = _run_summary(ref_dir), _run_summary(run_dir)
    context = f"seed {SEED}, faults {faults}"
    assert a["log"] == b["log"], context  # every loss and every validation metric, bit for bit
    assert a["best_rsum"] == b["best_rsum"] and a["best"] == b["best"], context
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        np.testing.assert_array_equal(a["weights"][k], b["weights"][k], err_msg=context)
    leftovers = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("."))
    assert all(".partial" in n or n.endswith(".old") for n in leftovers), leftovers
    print(f"training: {context}; final val rsum {a['best_rsum']}")


def _images(tmp_path: Path, n: int) -> tuple[Path, Path]:
    images = tmp_path / "images"
    images.mkdir()
    rows = ["image,caption,split"]
    for i in range(n):
        r = np.random.default_rng(i)
        yy, xx = np.mgrid[0:48, 0:64]
        arr = np.stack([xx * (i + 1) * 3 % 256, yy * (i + 2) * 5 % 256, (xx + yy) * 7 % 256], -1)
        arr = np.clip(arr + r.integers(-30, 30, arr.shape), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(images / f"im{i}.png")
        split = "train" if i < n - 4 else "dev"
        rows += [f"im{i}.png,picture {i} caption {c},{split}" for c in range(5)]
    captions = tmp_path / "captions.csv"
    captions.write_text("\n".join(rows) + "\n")
    return images, captions


def _extract_code(images: Path, captions: Path, out: Path, hook: str = "", extra: tuple[str, ...] = ()) -> str:
    """The extraction command (`extra`: more arguments); `hook` (statements run after `import
    itmatch.features.extract as e` and `import itmatch.features.extract_split as s`, one split's extraction,
    with os and signal imported) may patch the extractor, e.g. to kill the process at a chosen moment."""
    argv = ["extract", str(images), str(captions), "--out", str(out), "--batch-size", "2", *extra]
    # Progress is saved every 2 images instead of 256 so that every kill leaves resumable state.
    return ("import os, signal, sys\nimport itmatch.features.extract as e\nimport itmatch.features.extract_split as s\n"
            f"s.FLUSH_IMAGES = 2\n{hook}\nimport torch\ntorch.set_num_threads(1)\nfrom itmatch.cli import main\n"
            f"sys.exit(main({argv!r}))\n")


def test_extraction_killed_at_random_points_resumes_to_identical_arrays(tmp_path):
    rng = random.Random(SEED + 1)
    images, captions = _images(tmp_path, 24)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    startup, work = _reference(_extract_code(images, captions, ref_dir), ref_dir / "train.progress.json")
    faults = _kill_and_resume(_extract_code(images, captions, run_dir), run_dir / "train.progress.json", rng,
                              startup, work)
    assert faults, "no kill landed: the job finished before every kill moment"
    context = f"seed {SEED + 1}, faults {faults}"
    _assert_same_extraction(ref_dir, run_dir, context, ("features_sha256",))
    print(f"extraction: {context}")


def _assert_same_extraction(ref_dir: Path, run_dir: Path, context: str, meta_keys: tuple[str, ...]) -> None:
    """The killed-and-resumed extraction in `run_dir` equals the uninterrupted one in `ref_dir`: arrays,
    captions, ids, the `meta_keys` of each split's meta.json, and no leftover progress or partial file."""
    from itmatch.data.precomp import read_precomp

    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (ref_dir, run_dir))
    for split in ("train", "dev"):
        a, b = read_precomp(ref_dir, split), read_precomp(run_dir, split, verify_checksum=True)
        np.testing.assert_array_equal(np.asarray(a.images), np.asarray(b.images), err_msg=context)
        assert a.captions == b.captions and a.ids == b.ids, context
        for key in meta_keys:
            assert meta_a["splits"][split][key] == meta_b["splits"][split][key], (split, key, context)
    assert not list(run_dir.glob("*.progress.json")) and not list(run_dir.glob("*.partial")), context


def test_extraction_update_killed_at_random_points_resumes_to_identical_arrays(tmp_path):
    """A re-run after photos were replaced and a caption edited (docs/reliability.md, row 5c) rebuilds the
    split with the unchanged rows copied; killed at random moments and resumed, it ends bit-identical to an
    uninterrupted update."""
    from itmatch.data.precomp import read_precomp

    rng = random.Random(SEED + 3)
    images, captions = _images(tmp_path, 24)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    for out in (ref_dir, run_dir):
        _reference(_extract_code(images, captions, out), out / "train.progress.json")
    replaced = [f"im{i}.png" for i in range(0, 20, 3)]
    for k, name in enumerate(replaced):
        arr = np.random.default_rng(100 + k).integers(0, 256, (40, 56, 3), dtype=np.uint8)
        Image.fromarray(arr).save(images / name)
    captions.write_text(captions.read_text().replace("picture 4 caption 2", "an edited caption"))
    startup, work = _reference(_extract_code(images, captions, ref_dir), ref_dir / "train.progress.json")
    faults = _kill_and_resume(_extract_code(images, captions, run_dir), run_dir / "train.progress.json", rng,
                              startup, work)
    assert faults, "no kill landed: the job finished before every kill moment"
    context = f"seed {SEED + 3}, faults {faults}"
    _assert_same_extraction(ref_dir, run_dir, context, ("features_sha256", "captions_sha256", "image_files"))
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["splits"]["train"]["updated"]["image_files_changed"] == replaced, context
    assert "an edited caption" in read_precomp(run_dir, "train").captions
    print(f"extraction update: {context}")


# Moments of an update (changed photos) at which the extractor kills itself (SIGKILL), each one a window in
# which a random kill of the test above can land: a resumed run once lost meta.json's `updated` record there
# (it finished the split from its progress file without knowing what the update had changed) or refused to
# continue (the old captions and ids gone, the old features still there: taken for another extraction's).
_UPDATE_KILLS = {
    "before_rename": ("def killed(*a):\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "s.finish_array = killed"),
    "after_rename": ("real = s.finish_array\n"
                     "def killed(*a):\n"
                     "    real(*a)\n"
                     "    os.kill(os.getpid(), signal.SIGKILL)\n"
                     "s.finish_array = killed"),
    "after_meta": ("real = e.write_json_atomic\n"
                   "def killed(path, obj):\n"
                   "    real(path, obj)\n"
                   "    if os.path.basename(path) == 'meta.json':\n"
                   "        os.kill(os.getpid(), signal.SIGKILL)\n"
                   "e.write_json_atomic = killed"),
}


@pytest.mark.parametrize("moment", list(_UPDATE_KILLS))
def test_extraction_update_killed_at_each_finishing_step_records_what_changed(tmp_path, moment):
    """An update killed at a given moment of finishing its split (before/after its features replace the old
    ones, after meta.json records them but before the progress file is removed) and resumed ends with the
    uninterrupted update's arrays and meta.json record, `updated` included."""
    import shutil

    images, captions = _images(tmp_path, 10)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    first = _run(_extract_code(images, captions, ref_dir))
    assert first.wait() == 0, first.communicate()[1][-3000:]
    shutil.copytree(ref_dir, run_dir)
    replaced = ["im0.png", "im3.png"]
    for k, name in enumerate(replaced):
        arr = np.random.default_rng(100 + k).integers(0, 256, (40, 56, 3), dtype=np.uint8)
        Image.fromarray(arr).save(images / name)
    captions.write_text(captions.read_text().replace("picture 4 caption 2", "an edited caption"))
    for out, hook in ((ref_dir, ""), (run_dir, _UPDATE_KILLS[moment]), (run_dir, "")):
        proc = _run(_extract_code(images, captions, out, hook))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == (-signal.SIGKILL if hook else 0), err[-3000:]
    _assert_same_extraction(ref_dir, run_dir, moment, ("features_sha256", "captions_sha256", "image_files"))
    meta_a, meta_b = (json.loads((d / "meta.json").read_text())["splits"]["train"] for d in (ref_dir, run_dir))
    assert meta_a["updated"] == {**meta_b["updated"], "at": meta_a["updated"]["at"]}, moment
    assert meta_b["updated"]["image_files_changed"] == replaced
    assert meta_b["updated"]["captions_changed"] == ["im4.png"]
    assert _untimed_meta(meta_a) == _untimed_meta(meta_b), moment


# Moments of a caption-only update and of a --scales c3,c4,c5 extraction at which the extractor kills itself:
# a resumed caption update once lost meta.json's `updated` (the captions already rewritten), and a resumed
# multi-scale run kept the old finer maps (update) or refused to continue (first extraction) after a kill
# between the renames of its arrays.
_MORE_KILLS = {
    # (a caption-only update rewrites the captions in features/updates.py)
    "captions_rewritten": ("import itmatch.features.updates as u\n"
                           "real = u.write_captions\n"
                           "def killed(*a, **k):\n"
                           "    real(*a, **k)\n"
                           "    os.kill(os.getpid(), signal.SIGKILL)\n"
                           "u.write_captions = killed"),
    "between_renames": ("real = s.finish_array\n"
                        "def killed(*a):\n"
                        "    real(*a)\n"
                        "    if str(a[0]).endswith('train_ims_c3.npy'):\n"
                        "        os.kill(os.getpid(), signal.SIGKILL)\n"
                        "s.finish_array = killed"),
}


@pytest.mark.parametrize("update", [False, True], ids=["first", "update"])
@pytest.mark.parametrize("moment", list(_MORE_KILLS))
def test_extraction_killed_at_a_caption_update_or_between_renames_resumes_identically(tmp_path, moment, update):
    """Killed right after a caption-only update rewrote the captions, or between the renames of a multi-scale
    extraction's arrays (c5 and c3 renamed, c4 not), and resumed: every array and meta.json's record (`updated`
    included) equal the uninterrupted run's."""
    import shutil

    if moment == "captions_rewritten" and not update:
        pytest.skip("a first extraction writes no caption update")
    extra = ("--scales", "c3,c4,c5") if moment == "between_renames" else ()
    images, captions = _images(tmp_path, 8)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    if update:
        first = _run(_extract_code(images, captions, ref_dir, extra=extra))
        assert first.wait() == 0, first.communicate()[1][-3000:]
        shutil.copytree(ref_dir, run_dir)
        if moment == "between_renames":
            arr = np.random.default_rng(100).integers(0, 256, (40, 56, 3), dtype=np.uint8)
            Image.fromarray(arr).save(images / "im1.png")
        captions.write_text(captions.read_text().replace("picture 2 caption 2", "an edited caption"))
    for out, hook in ((ref_dir, ""), (run_dir, _MORE_KILLS[moment]), (run_dir, "")):
        proc = _run(_extract_code(images, captions, out, hook, extra))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == (-signal.SIGKILL if hook else 0), err[-3000:]
    _assert_same_extraction(ref_dir, run_dir, moment, ("features_sha256", "captions_sha256", "image_files"))
    for name in ("train_ims_c3.npy", "train_ims_c4.npy") if extra else ():
        np.testing.assert_array_equal(np.load(run_dir / name), np.load(ref_dir / name), err_msg=name)
    meta_a, meta_b = (json.loads((d / "meta.json").read_text())["splits"]["train"] for d in (ref_dir, run_dir))
    assert _untimed_meta(meta_a) == _untimed_meta(meta_b), moment
    if update:
        assert meta_b["updated"]["captions_changed"] == ["im2.png"], moment
    assert not list(run_dir.glob("*.captions-update.json")), moment


@pytest.mark.parametrize("reverted", ["both", "one"])
def test_an_edit_reverted_after_a_stopped_caption_update_is_not_recorded_as_a_change(tmp_path, reverted):
    """Two images' captions edited, the caption-only update killed right after it rewrote the caption file, then
    both edits (or one) undone before the next run: meta.json lists only the images whose captions still differ
    from the extraction's (none: its entry is the extraction's, unchanged), and the caption file is the text."""
    images, captions = _images(tmp_path, 8)
    out = tmp_path / "features"
    first = _run(_extract_code(images, captions, out))
    assert first.wait() == 0, first.communicate()[1][-3000:]
    extracted = json.loads((out / "meta.json").read_text())["splits"]["train"]
    original = captions.read_text()
    kept_edit = original.replace("picture 3 caption 1", "a caption still edited")
    captions.write_text(kept_edit.replace("picture 2 caption 2", "an edit undone"))
    for hook in (_MORE_KILLS["captions_rewritten"], ""):
        if not hook:
            captions.write_text(original if reverted == "both" else kept_edit)
        proc = _run(_extract_code(images, captions, out, hook))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == (-signal.SIGKILL if hook else 0), err[-3000:]
    meta = json.loads((out / "meta.json").read_text())["splits"]["train"]
    text = (out / "train_caps.txt").read_text()
    assert "an edit undone" not in text and ("a caption still edited" in text) == (reverted == "one")
    if reverted == "both":
        assert meta == extracted
    else:
        assert meta["updated"]["captions_changed"] == ["im3.png"]
    assert not list(out.glob("*.captions-update.json"))


def _untimed_meta(info: dict) -> dict:
    """A split's meta.json entry without what depends on the run's timing (and how much it computed)."""
    skip = {"seconds_this_run", "images_per_second", "num_threads"}
    return {k: ({**v, "at": None} if k == "updated" else v) for k, v in info.items() if k not in skip}


def _evaluate_code(ckpt: Path, data: Path, blocks: Path, out: Path) -> str:
    # A budget of 40 KB cuts the 40 x 200 test matrix into ~1300 blocks, so that kills land between blocks.
    argv = ["evaluate", str(ckpt), "--data", str(data), "--split", "test", "--budget-gb", str(4e4 / 2**30),
            "--threads", "1", "--resume-dir", str(blocks), "--json", str(out), "--quiet"]
    # Finished blocks are written every FLUSH_SECONDS (60) of scoring; here after every block.
    return ("import sys; import itmatch.inference.score_cache as c; c.FLUSH_SECONDS = 0.0; "
            f"from itmatch.cli import main; sys.exit(main({argv!r}))")


def _parts(blocks: Path) -> int:
    return len(list(blocks.glob("*/part-*.safetensors")))


def test_evaluation_killed_at_random_points_resumes_to_identical_metrics(tiny_precomp, tmp_path):
    """Kills land at random points of the scoring, drawn as a number of finished blocks rather than a time
    (a scoring of a few seconds on a loaded machine varies in speed more than the windows between kills)."""
    from itmatch.engine.train import train
    from itmatch.models.registry import resolve_config

    cfg = resolve_config("scan_t2i_avg", {"model": {"embed_size": 32, "word_dim": 16},
                                          "data": {"path": str(tiny_precomp)},
                                          "train": {"epochs": 1, "batch_size": 32, "val_images": 40}})
    train(cfg, tmp_path / "run", progress=False)
    rng = random.Random(SEED + 2)
    ckpt = tmp_path / "run" / "best"
    reference = _run(_evaluate_code(ckpt, tiny_precomp, tmp_path / "ref_blocks", tmp_path / "reference.json"))
    total = 0  # blocks of the plan, as seen while the reference scores (one part per block here)
    while reference.poll() is None:
        total = max(total, _parts(tmp_path / "ref_blocks"))
        time.sleep(0.01)
    assert reference.returncode == 0, reference.communicate()[1][-3000:]
    assert total > 100, total
    blocks, faults = tmp_path / "blocks", []
    code = _evaluate_code(ckpt, tiny_precomp, blocks, tmp_path / "killed.json")
    for _ in range(KILLS):
        done = _parts(blocks)
        target = done + rng.randint(1, max(1, int(0.8 * (total - done))))
        proc = _run(code)
        while proc.poll() is None and _parts(blocks) < target:
            time.sleep(0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            faults.append(f"kill {len(faults) + 1} after {_parts(blocks)} of {total} blocks")
    final = _run(code)
    assert final.wait(timeout=600) == 0, final.communicate()[1][-3000:]
    assert faults, "no kill landed: the job finished before every kill moment"
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("reference", "killed"))
    assert b["resumed"]["blocks"] >= 1, faults  # the last run continued from the killed runs' blocks
    b.pop("resumed")
    assert _untimed(a) == _untimed(b), f"seed {SEED + 2}, faults {faults}"
    assert not blocks.exists() and not (tmp_path / "ref_blocks").exists()
    print(f"evaluation: seed {SEED + 2}, faults {faults}")
