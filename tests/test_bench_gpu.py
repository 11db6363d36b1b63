"""bench/flickr8k.py --config gpu: every row of issue 24 is defined and resolves to a valid config, the GPU
schedule files train, a CPU-only machine is stopped before any work with the CPU schedule's hint, a killed
row resumes and a row whose checkpoint is missing is reported."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SHARED, load_script

from itmatch.config import load_yaml, parse_overrides
from itmatch.engine.train import train
from itmatch.models.registry import resolve_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/flickr8k.py")


def test_every_row_of_the_issue_is_defined_and_resolves(bench):
    gpu = bench.GPU
    wanted = {"vsepp", "summax_t2i", "scan_t2i_avg", "scan_t2i_lse", "scan_i2t_avg", "scan_i2t_lse",
              "scan_ensemble_t2i_avg+i2t_lse", "oan", "oan_eq11", "oan_no_intra_neg", "oan_no_inter_attn",
              "oan_no_intra_attn", "oan_no_attn", "oan_bilstm", "mmca", "mmca_alpha0", "mmca_h512", "save_nosa",
              "save_dsa", "save_asa", "save_asa_ms2", "save_asa_ms3", "save_nl_ms2", "save_dsa_ms2",
              "save_asa_t2i_lse", "save_asa_ms3_both", "sman", "sman_im", "sman_im_loc", "sman_sim", "sman_inter",
              "scan_i2t_lse_ft", "scan_i2t_lse_frozen_more", "scan_i2t_lse_lite2", "scan_i2t_lse_lite2_ft"}
    assert wanted <= set(gpu.rows) and len(set(gpu.rows)) == len(gpu.rows)
    assert all(f"{row}_seed1" in gpu.rows for row in bench.HEADLINE)  # two seeds for the headline rows
    bench.check_rows_resolve(gpu)  # unknown keys or bad values would raise ConfigError


def test_the_shipped_scan_row_fits_a_shipped_model_where_the_paper_s_d_does_not(bench):
    """The row exists because SCAN at D = 1024 is over the shipped models' limit (docs/training.md)."""
    from itmatch.pretrained import MAX_BYTES

    captions = SHARED / "flickr8k" / "Flickr8k.token.txt"
    if not captions.is_file():
        pytest.skip(f"needs the Flickr8K captions for the vocabulary's size: {captions} not found (../shared)")
    sizes = load_script("bench/pretrained_sizes.py")
    vocab = sizes.flickr8k_vocab_size(captions)
    preset, overrides = bench.GPU_CONTROLS[bench.SHIPPED_SCAN]
    d, shipped = sizes.fp16_megabytes(preset, vocab, False, overrides)
    paper_d, paper = sizes.fp16_megabytes(preset, vocab, False)
    assert (d, paper_d) == (960, 1024)
    assert shipped * 1e6 < MAX_BYTES < paper * 1e6


def test_gpu_rows_keep_their_papers_schedules(bench):
    def config(row):
        preset = bench.base_preset(row, bench.GPU)
        return bench.row_config(preset, bench.schedule_of(row, bench.GPU), bench.GPU.overrides.get(row, []))

    scan, oan, mmca, sman = (config(r) for r in ("scan_t2i_avg", "oan", "mmca", "sman"))
    assert (scan.train.lr, scan.train.lr_update, scan.train.epochs, scan.model.embed_size) == (2e-4, 15, 30, 1024)
    assert (oan.train.lr, oan.train.epochs, oan.model.embed_size, oan.train.weight_decay) == (5e-4, 24, 512, 1e-6)
    assert (mmca.train.batch_size, mmca.model.embed_size, mmca.model.mmca.train_negatives) == (64, 256, 0)
    assert (sman.train.optimizer, sman.train.epochs, sman.train.grad_clip) == ("adadelta", 60, 0.1)
    assert sman.train.grad_clip_mode == "value"  # (per coordinate: docs/sman.md, "Gradient clipping at 0.1")
    # the warm-up epoch for the attention heads, which stall without it, with the control that measures it; none
    # for VSE++ (it stalls three epochs, then ends higher: docs/training.md), with its warm-up runs as the control
    assert scan.loss.warmup_epochs == oan.loss.warmup_epochs == config("vsepp_warmup").loss.warmup_epochs == 1
    assert sman.loss.warmup_epochs == config("sman_adam5e-4").loss.warmup_epochs == 1  # (it stalls without: sman.md)
    assert mmca.loss.warmup_epochs == config("vsepp").loss.warmup_epochs == 0
    assert config("scan_t2i_avg_no_warmup").loss.warmup_epochs == config("sman_no_warmup").loss.warmup_epochs == 0
    assert config("vsepp_warmup_seed1").train.seed == config("vsepp_seed1").train.seed == 1
    # the best single model's three seeds: the same settings but the seed, each on the Lite2 features
    decay4 = [config(f"mmca_alpha0_lite2_decay4{s}") for s in ("", "_seed1", "_seed2")]
    assert [c.train.seed for c in decay4] == [0, 1, 2] and all(c.train.lr_update == 4 for c in decay4)
    assert all(dataclasses.replace(c.train, seed=0) == decay4[0].train and c.model == decay4[0].model
               for c in decay4)
    assert {bench.features_dir(f"mmca_alpha0_lite2_decay4{s}", bench.GPU) for s in ("", "_seed1", "_seed2")} == {
        bench.DATA_LITE2}
    both = config("save_asa_ms3_both").model
    assert both.direction == "both" and (both.scan.lambda_softmax, both.scan.i2t_lambda_softmax) == (9.0, 4.0)
    assert (both.pool, both.scan.i2t_pool) == ("lse", "avg")  # SAVE Table 4's settings, t-i LSE and i-t AVG
    ft = config("scan_i2t_lse_ft").train
    assert ft.finetune_backbone and ft.lr == 2e-5 and ft.init_from.endswith("flickr8k_gpu/scan_i2t_lse/best")
    assert config("scan_i2t_lse_ft").model.pixels  # as the trainer records it: a resumed row's run matches


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "schedule"), [("scan_i2t_lse", "gpu.yaml"), ("meanpool", "gpu_no_warmup.yaml")])
def test_the_gpu_schedule_files_train_a_few_batches(preset, schedule, tiny_precomp, tmp_path):
    """A smoke run of each schedule file (2 batches on the tiny fixture; the full schedule needs a GPU)."""
    cfg = resolve_config(preset, load_yaml(ROOT / "configs" / "flickr8k" / schedule), parse_overrides(
        [f"data.path={tiny_precomp}", "model.embed_size=16", "model.word_dim=8", "train.epochs=1",
         "train.max_batches=2", "train.batch_size=16", "train.val_images=20", "train.threads=1",
         "train.device=cpu"]))  # (the files ask for CUDA; the smoke run is on the CPU)
    result = train(cfg, tmp_path / "run", progress=False)
    assert result["best_epoch"] == 1 and (tmp_path / "run" / "best" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's message")
def test_gpu_bench_on_a_cpu_machine_stops_before_any_work_with_the_cpu_hint(tmp_path):
    run = ROOT / "runs" / "flickr8k_gpu" / "vsepp"
    existed = run.exists()  # (a checkout may hold a run of its own, perhaps training)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "flickr8k.py"), "--config", "gpu", "--row", "vsepp"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no CUDA device" in done.stderr
    assert "use the CPU schedule (--config cpu" in done.stderr
    assert "+ itmatch" not in done.stdout and run.exists() == existed


def _fake_run(bench, profile, row: str, epochs_done: int, with_best: bool) -> None:
    """A run directory as the trainer leaves it: its config, `last` after `epochs_done` epochs, maybe `best`."""
    cfg = bench.row_config(bench.base_preset(row, profile), bench.schedule_of(row, profile),
                           profile.overrides.get(row, []))
    run = Path(profile.runs) / row
    (run / "last").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "last" / "state.json").write_text(json.dumps({"epoch": epochs_done, "batch": 0}))
    if with_best:
        (run / "best").mkdir()
        (run / "best" / "config.json").write_text(json.dumps(cfg.to_dict()))


def test_an_ensemble_member_evaluated_elsewhere_is_not_reported_as_not_started(bench, tmp_path):
    """A member whose row is in the table but whose run is not on this machine (trained on a lent GPU, or gone with
    a machine) is named as such: running the ensemble's row would train it again."""
    import dataclasses

    from itmatch.engine.results import DEVICE_HEADER, write_rows

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"))
    row = {**dict.fromkeys(DEVICE_HEADER, ""), "name": "scan_i2t_lse", "rsum": "283.3", "device": "GPU X"}
    write_rows(gpu.results, DEVICE_HEADER, [row])
    status = bench.row_status("ensemble_mmca_alpha0_lite2+scan_i2t_lse", gpu)
    assert status == ("not evaluated; mmca_alpha0_lite2-flickr8k: shipped model (fp16 weights of row "
                      "mmca_alpha0_lite2, rsum 283.4); scan_i2t_lse: no run here, although its row is evaluated "
                      "(rsum 283.3, GPU X): the row trains it again")


def test_an_ensemble_reads_a_shipped_member_by_name_and_trains_only_the_others(bench, tmp_path, monkeypatch):
    """A member whose run is gone with a machine but whose model ships (mmca_alpha0_lite2-flickr8k) is read by name,
    on its row's features (Lite2), never trained again; its weights' digest is its package's; the row says where its
    members trained, the shipped one as such."""
    import dataclasses

    from itmatch.engine.results import read_rows
    from itmatch.pretrained import shipped

    row, package = "ensemble_mmca_alpha0_lite2+scan_i2t_lse", "mmca_alpha0_lite2-flickr8k"
    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"),
                              history=str(tmp_path / "history.csv"), on_cpu=True)
    assert bench.row_members(row, gpu) == ([package, "scan_i2t_lse"], [bench.DATA_LITE2, bench.DATA])
    _fake_run(bench, gpu, "scan_i2t_lse", epochs_done=30, with_best=True)
    (tmp_path / "runs" / "scan_i2t_lse" / "best" / "state.json").write_text(json.dumps({"devices": ["GPU X"]}))
    ran = []

    def evaluate(cmd, ranks=1):
        ran.append(cmd)
        if cmd[1] == "evaluate":
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({
                "image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0},
                "text_to_image": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "rsum": 12.0, "protocol": "1k",
                "eval_seconds": 1.0}))

    monkeypatch.setattr(bench, "run", evaluate)
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile=None: None)
    bench.run_row(row, 2, profile=gpu)
    assert [cmd[1] for cmd in ran] == ["evaluate"]  # (nothing trained: scan_i2t_lse has finished, the other ships)
    cmd = ran[0]
    assert cmd[2:4] == [package, f"{tmp_path}/runs/scan_i2t_lse/best"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--data"] == [bench.DATA_LITE2, bench.DATA]
    written = next(r for r in read_rows(tmp_path / "gpu.csv") if r["name"] == row)
    assert written["model"] == "mmca_alpha0+scan_i2t_lse"
    assert written["device"].endswith("; trained on CPU AMD EPYC, 2 threads (shipped fp16) + GPU X")
    manifest = json.loads((shipped()[package].path / "manifest.json").read_text())
    assert bench.weights_digest(package, gpu) == manifest["files"]["model.safetensors"]["sha256"]
    assert package not in bench.without_checkpoint([package, "scan_i2t_lse"], gpu)


def test_a_killed_row_resumes_and_a_missing_checkpoint_is_reported(bench, tmp_path, monkeypatch, capsys):
    import dataclasses

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"))
    _fake_run(bench, gpu, "vsepp", epochs_done=7, with_best=True)  # killed in its 8th epoch of 30
    _fake_run(bench, gpu, "scan_i2t_lse", epochs_done=30, with_best=False)  # finished, `best` lost
    assert "vsepp: training, epoch 7 of 30 done" in bench.row_status("vsepp", gpu)
    assert "CHECKPOINT MISSING" in bench.row_status("scan_i2t_lse", gpu)
    (tmp_path / "runs" / "oan").mkdir()
    (tmp_path / "runs" / "oan" / "config.json").write_text("{}")  # (killed before its first checkpoint)
    assert bench.row_status("oan", gpu) == "not evaluated; oan: started, no checkpoint yet"
    assert bench.row_status("sman", gpu) == "not evaluated; sman: not started"
    monkeypatch.setattr(bench, "DRY_RUN", True)
    bench.run_row("vsepp", 0, profile=gpu)
    train_line = next(line for line in capsys.readouterr().out.splitlines() if " train " in line)
    assert f"--out {tmp_path}/runs/vsepp" in train_line and train_line.endswith("--resume")
    monkeypatch.setattr(bench, "DRY_RUN", False)
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile=None: None)  # (no extraction in a test)
    with pytest.raises(bench.MissingCheckpoint, match="scan_i2t_lse/best"):
        bench.run_row("scan_i2t_lse", 0, profile=gpu)


def test_a_views_row_makes_its_views_before_it_trains(bench, tmp_path, monkeypatch):
    """The features a row reads include the views its data.train_views names (resolved from its config), so a clean
    machine extracts them before training; a row without views asks only for its photos' features."""
    import dataclasses

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"))
    monkeypatch.setattr(bench, "DRY_RUN", True)
    extracted = []
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile=None: extracted.append(data))
    bench.run_row("mmca_alpha0_lite2_decay4_ema_views4", 0, profile=gpu)
    assert extracted == [bench.DATA_LITE2, *bench.LITE2_VIEWS]
    extracted.clear()
    bench.run_row("mmca_alpha0_lite2_decay4_ema", 0, profile=gpu)
    assert extracted == [bench.DATA_LITE2]


def test_save_without_self_attention_is_the_scan_run_it_evaluates(bench):
    """save_nosa (and its t-i LSE row) evaluate SCAN's GPU runs instead of training the same model again: the two
    presets resolve to the same schedule and settings, build the same head, and start from the same weights."""
    from itmatch.config import flatten
    from itmatch.models.registry import arch

    gpu = bench.GPU
    for alias, scan_row in (("save_nosa", "scan_i2t_avg"), ("save_nosa_t2i_lse", "scan_t2i_lse")):
        assert gpu.ensembles[alias] == [scan_row]
        save = bench.row_config(alias, bench.schedule_of("save_nosa", gpu), [])  # (the row's preset of its name)
        scan = bench.row_config(scan_row, bench.schedule_of(scan_row, gpu), gpu.overrides.get(scan_row, []))
        for cfg in (save, scan):
            cfg.model.vocab_size, cfg.model.img_dim = 50, 1280
        a, b = flatten(save.to_dict()), flatten(scan.to_dict())
        named = {"name", "preset", "model.arch", "model.save.attention",  # (and the lambdas SAVE keeps for t-i)
                 "model.scan.lambda_softmax", "model.scan.lambda_lse"}
        assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} <= named
        built = []
        for cfg in (save, scan):
            torch.manual_seed(0)
            built.append(arch(cfg.model).build(cfg.model))
        heads = [{k: v for k, v in vars(m.head).items() if not k.startswith("_")} for m in built]
        assert heads[0] == heads[1]  # (the lambdas each head uses: SCAN's of its direction)
        weights = [list(m.state_dict().values()) for m in built]
        assert all(torch.equal(x, y) for x, y in zip(*weights, strict=True))
        feats, tokens = torch.relu(torch.randn(3, 49, 1280)), torch.randint(1, 50, (4, 7))
        lengths = torch.tensor([7, 6, 5, 3])
        with torch.no_grad():  # the same computation, not only the same parameters
            scores = [m.eval().head(m.encode_images(feats), m.encode_texts(tokens, lengths)) for m in built]
        assert torch.equal(*scores)


def test_the_attention_scale_controls_change_only_their_scale(bench):
    gpu = bench.GPU
    oan = bench.row_config("oan", bench.schedule_of("oan_lambda_scan", gpu), gpu.overrides["oan_lambda_scan"])
    assert (oan.model.oan.lambda_tv, oan.model.oan.lambda_vt, oan.train.epochs) == (9.0, 4.0, 24)
    dsa = bench.row_config("save_dsa", bench.schedule_of("save_dsa_lambda9", gpu), gpu.overrides["save_dsa_lambda9"])
    assert (dsa.model.save.attention, dsa.model.save.dsa_lambda) == ("dsa", 9.0)


def test_the_docs_views_of_the_gpu_table_name_rows_the_bench_produces(bench):
    import re

    from itmatch.engine.results import view_pages

    names = set()
    for page in view_pages(ROOT / "docs"):
        for rows in re.findall(r"<!-- (?:results|versus|curves): flickr8k_gpu ([\w.+ -]+?) -->", page.read_text()):
            names |= set(rows.split())
        for claims in re.findall(r"<!-- claims: flickr8k_gpu ([\w.+ =>-]+?) -->", page.read_text()):
            names |= {side for claim in claims.split() for side in re.split(">=?", claim)
                      if not re.fullmatch(r"[\d.]+", side)}
    assert names and names <= set(bench.GPU.rows)


def test_a_save_run_from_before_both_lambdas_were_kept_still_matches_its_row(bench, tmp_path):
    """CPU SAVE runs trained before the presets kept both directions' lambdas hold the i-t 4 / 5 in model.lambda_*
    (where SCAN's options were, before model.scan); an i-t SAVE model does not read those, so the bench resumes /
    evaluates them; a real difference still stops it."""
    schedule = bench.SCHEDULES["save_dsa"]
    old = bench.row_config("save_dsa", schedule, []).to_dict()
    for key in ("lambda_softmax", "lambda_lse", "raw_feature_norm", "clip_slope"):  # their place then
        old["model"][key] = old["model"]["scan"].pop(key)
    old["model"]["lambda_softmax"], old["model"]["lambda_lse"] = 4.0, 5.0
    (tmp_path / "config.json").write_text(json.dumps(old))
    bench.check_run_matches(str(tmp_path), "save_dsa", schedule, [])  # no exit
    old["model"]["embed_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="model.embed_size=64"):
        bench.check_run_matches(str(tmp_path), "save_dsa", schedule, [])


def test_device_cpu_runs_a_paper_schedule_on_the_cpu_and_its_row_names_the_cpu(bench, tmp_path, monkeypatch, capsys):
    """--config gpu --device cpu: train and evaluate carry --device cpu (the schedule files ask for CUDA), a run
    trained so still matches its row, and the row's device column and command say where and how it ran."""
    import dataclasses

    cpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"), on_cpu=True)
    _fake_run(bench, cpu, "vsepp", epochs_done=30, with_best=True)
    saved = json.loads((tmp_path / "runs" / "vsepp" / "config.json").read_text())
    saved["train"]["device"] = "cpu"  # as `itmatch train --device cpu` records it
    (tmp_path / "runs" / "vsepp" / "config.json").write_text(json.dumps(saved))
    bench.check_run_matches(str(tmp_path / "runs" / "vsepp"), "vsepp", bench.schedule_of("vsepp", cpu), [])
    monkeypatch.setattr(bench, "DRY_RUN", True)
    bench.run_row("vsepp", 2, profile=cpu)
    evaluate = next(line for line in capsys.readouterr().out.splitlines() if " evaluate " in line)
    assert evaluate.endswith("--device cpu")
    result = {"image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "text_to_image": {"r1": 1.0, "r5": 2.0, "r10": 3.0},
              "rsum": 12.0, "protocol": "1k", "eval_seconds": 1.0}
    (tmp_path / "vsepp.test.json").write_text(json.dumps(result))
    bench.write_device_row("vsepp", "vsepp", tmp_path / "vsepp.test.json",
                           "python bench/flickr8k.py --config gpu --device cpu --row vsepp", cpu, threads=2)
    row = (tmp_path / "gpu.csv").read_text().splitlines()[1]
    assert "--device cpu --row vsepp" in row and ", 2 threads" in row and "CPU " in row


def test_an_ensemble_of_members_on_different_features_gives_each_its_data(bench, tmp_path, monkeypatch, capsys):
    """MMCA alpha = 0 on Lite2 cells with VSE++ on Lite0 cells: one --data per checkpoint, in the members' order,
    and safe pruning (both heads bound their score around a global cosine); one family on one backbone: one --data."""
    import dataclasses

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"), on_cpu=True)
    for member in ("mmca_alpha0_lite2", "vsepp", "mmca_alpha0_lite2_seed1"):
        _fake_run(bench, gpu, member, epochs_done=bench.row_config(
            bench.base_preset(member, gpu), bench.schedule_of(member, gpu), []).train.epochs, with_best=True)
    monkeypatch.setattr(bench, "DRY_RUN", True)
    for row, data in (("ensemble_mmca_alpha0_lite2+vsepp", [bench.DATA_LITE2, bench.DATA]),
                      ("mmca_alpha0_lite2_ensemble_seed0+seed1", [bench.DATA_LITE2])):
        bench.run_row(row, 1, profile=gpu)
        evaluate = next(line for line in capsys.readouterr().out.splitlines() if " evaluate " in line)
        assert [part.split()[0] for part in evaluate.split("--data ")[1:]] == data
        assert "--prune" in evaluate.split()


def test_device_cpu_is_refused_for_the_cpu_schedule():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "flickr8k.py"), "--device", "cpu", "--status"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--device cpu is for --config gpu" in done.stderr


def test_rows_side_by_side_extract_their_shared_features_once_on_a_gpu_in_batches_of_128(bench, tmp_path,
                                                                                        monkeypatch):
    """A GPU session's driver starts rows together: two multi-scale SAVE rows used to run two extractions into the
    same folder at once; now one extracts (batch 128 on the GPU) and the other finds the features complete."""
    import threading
    import time

    extractions = []

    def extract(cmd, ranks=1):
        extractions.append(cmd)
        time.sleep(0.3)  # long enough for the second row to arrive meanwhile
        for split in ("train", "dev", "test"):
            (root / bench.DATA_MS / f"{split}_ims_c3.npy").parent.mkdir(parents=True, exist_ok=True)
            (root / bench.DATA_MS / f"{split}_ims_c3.npy").touch()

    root = tmp_path / "itmatch"  # (the photos and captions, ../shared/data/flickr8k, beside it)
    (root / bench.IMAGES).mkdir(parents=True)
    (root / bench.CAPTIONS).write_text("")
    monkeypatch.setattr(bench, "ROOT", root)
    monkeypatch.setattr(bench, "run", extract)
    rows = [threading.Thread(target=bench.ensure_features, args=(bench.DATA_MS, bench.GPU)) for _ in range(2)]
    for row in rows:
        row.start()
    for row in rows:
        row.join(10)
    assert len(extractions) == 1
    assert extractions[0][-4:] == ["--scales", "c3,c4,c5", "--batch-size", "128"]


def test_a_cpu_row_records_the_threads_it_ran_with_in_its_command(bench, tmp_path, monkeypatch, capsys):
    """The thread count changes a CPU row's numbers (float summation order), so the recorded command carries it as
    its device column does: the count given, or for --threads 0 (all cores) the count that meant here; a GPU row's
    command has none. The CPU schedule's rows (written by `itmatch evaluate --command`) likewise on a CPU."""
    import dataclasses

    cpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"),
                              history=str(tmp_path / "history.csv"), on_cpu=True)
    _fake_run(bench, cpu, "vsepp", epochs_done=30, with_best=True)
    result = {"image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "text_to_image": {"r1": 1.0, "r5": 2.0, "r10": 3.0},
              "rsum": 12.0, "protocol": "1k", "eval_seconds": 1.0}

    def evaluate(cmd, ranks=1):  # what `itmatch evaluate --json` leaves
        (tmp_path / "runs" / "vsepp.test.json").write_text(json.dumps(result))

    printing = bench.run
    monkeypatch.setattr(bench, "run", evaluate)
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile=None: None)
    from itmatch.engine.results import read_rows

    for threads, n in ((3, 3), (0, torch.get_num_threads())):
        bench.run_row("vsepp", threads, profile=cpu)
        row = next(r for r in read_rows(tmp_path / "gpu.csv") if r["name"] == "vsepp")
        assert row["command"] == f"python bench/flickr8k.py --config gpu --device cpu --row vsepp --threads {n}"
        assert row["device"].endswith(f", {n} thread{'s' if n != 1 else ''}")
        assert bench.parse_arguments(row["command"].split()[2:])[0].threads == n  # (as the bench takes it)
    assert bench.row_command("vsepp", bench.GPU, 0) == "python bench/flickr8k.py --config gpu --row vsepp"
    monkeypatch.setattr(bench, "run", printing)
    monkeypatch.setattr(bench, "DRY_RUN", True)
    for cuda, command in ((False, "python bench/flickr8k.py --row vsepp --threads 2"),
                          (True, "python bench/flickr8k.py --row vsepp")):  # (the CPU schedule runs on 'auto')
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        bench.run_row("vsepp", 2, profile=dataclasses.replace(bench.CPU, runs=str(tmp_path / "cpu_runs")))
        line = next(line for line in capsys.readouterr().out.splitlines() if " evaluate " in line)
        assert f"--command {command} --force" in line


def test_missing_lite0_features_are_extracted_as_the_readme_does_or_named_with_their_command(bench, tmp_path,
                                                                                            monkeypatch):
    """A fresh machine: the Lite0 grid every Lite0 row reads is extracted like the Lite2 and multi-scale ones (the
    README's command; on a GPU in batches of 128), once, not when complete; without the photos the error names
    what is missing and the command that makes the features."""
    import dataclasses

    extractions = []

    def extract(cmd, ranks=1):
        extractions.append(cmd)
        for split in ("train", "dev", "test"):
            (root / bench.DATA / f"{split}_ims.npy").parent.mkdir(parents=True, exist_ok=True)
            (root / bench.DATA / f"{split}_ims.npy").touch()

    root = tmp_path / "itmatch"
    monkeypatch.setattr(bench, "ROOT", root)
    monkeypatch.setattr(bench, "run", extract)
    with pytest.raises(bench.MissingFeatures) as missing:
        bench.ensure_features(bench.DATA, bench.CPU)
    message = str(missing.value)
    assert "runs/data/flickr8k_lite0 lacks train_ims.npy, dev_ims.npy, test_ims.npy" in message
    assert "../shared/data/flickr8k/images and ../shared/data/flickr8k/Flickr8k.token.txt" in message
    assert ("itmatch extract ../shared/data/flickr8k/images ../shared/data/flickr8k/Flickr8k.token.txt "
            "--out runs/data/flickr8k_lite0") in message
    assert extractions == []
    (root / bench.IMAGES).mkdir(parents=True)
    (root / bench.CAPTIONS).write_text("")
    bench.ensure_features(bench.DATA, bench.GPU)
    bench.ensure_features(bench.DATA, bench.GPU)  # complete now: not again
    assert extractions == [["itmatch", "extract", bench.IMAGES, bench.CAPTIONS, "--out", bench.DATA,
                            "--batch-size", "128"]]
    (root / bench.DATA / "dev_ims.npy").unlink()  # (a folder with some splits only: the rest is extracted)
    bench.ensure_features(bench.DATA, dataclasses.replace(bench.GPU, on_cpu=True))
    assert extractions[-1] == ["itmatch", "extract", bench.IMAGES, bench.CAPTIONS, "--out", bench.DATA]


def test_the_recall_figure_evaluates_again_only_rows_without_a_curve(bench, tmp_path, monkeypatch, capsys):
    """`--recall`: a row whose test JSON records its curve is drawn from it; one evaluated before curves were
    recorded is evaluated again into its JSON alone, its features made first; one with neither curve nor checkpoint
    here stops the figure."""
    import dataclasses

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), on_cpu=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "oan.test.json").write_text(json.dumps({"rsum": 261.2, "recall_curve": {}}))
    (tmp_path / "runs" / "vsepp.test.json").write_text(json.dumps({"rsum": 245.9}))
    (tmp_path / "runs" / "vsepp" / "best").mkdir(parents=True)
    (tmp_path / "runs" / "vsepp" / "best" / "config.json").write_text("{}")
    monkeypatch.setattr(bench, "DRY_RUN", True)
    extracted = []  # (the features of a row evaluated again are made first where missing: here, record the call)
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile: extracted.append(data))
    bench.recall_figure(["oan", "vsepp"], 2, gpu)
    assert extracted == [bench.DATA]  # vsepp's, not oan's (drawn from its JSON)
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]
    assert len(commands) == 2 and " evaluate " in commands[0] and "vsepp/best" in commands[0]
    assert f"--json {tmp_path}/runs/vsepp.test.json --force" in commands[0]  # its JSON, not the table's row
    assert "--results" not in commands[0] and "--device cpu" in commands[0]
    assert commands[1].startswith("+ itmatch analyze recall") and "--labels oan vsepp" in commands[1]
    assert commands[1].endswith("--out docs/results/recall/flickr8k_gpu.png --force")
    monkeypatch.setattr(bench, "DRY_RUN", False)
    with pytest.raises(SystemExit, match="row scan_i2t_lse: no recall curve .* no checkpoint of scan_i2t_lse"):
        bench.recall_figure(["oan", "scan_i2t_lse"], 2, gpu)


def test_a_study_across_sessions_shows_where_each_training_stands(bench, tmp_path, monkeypatch):
    """`--status` lists the perturbation studies too (the CPU's VSE++ study runs over several sessions); the
    reference is the table's finished run, which run_perturb passes as --original; a study run stopped after
    some epochs reads as training, and only then resumed, never reused."""
    import dataclasses

    # the committed GPU study's table, its runs trained on a lent GPU and not here
    assert bench.study_status("vsepp", dataclasses.replace(bench.GPU, runs=str(tmp_path / "elsewhere"))) == (
        "table in docs/results/perturb/flickr8k_gpu_vsepp.md; its runs are not on this machine")
    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), perturb_prefix="flickr8k_unrun")
    _fake_run(bench, gpu, "vsepp", epochs_done=30, with_best=True)
    shuffle = tmp_path / "runs" / "perturb" / "vsepp" / "shuffle"  # stopped after 5 epochs, with their best
    shutil.copytree(tmp_path / "runs" / "vsepp", shuffle)
    (shuffle / "last" / "state.json").write_text(json.dumps({"epoch": 5, "batch": 0}))
    status = bench.study_status("vsepp", gpu)
    assert status.startswith("no table yet; original: the vsepp row's run; shuffle: training, epoch 5 of 30 done")
    assert status.endswith("nouns: not started")
    monkeypatch.setattr(bench, "DRY_RUN", True)
    monkeypatch.setattr(bench, "run", lambda cmd, ranks=1: commands.append(cmd))
    commands = []
    bench.run_perturb("vsepp", 1, gpu, jobs=2)
    study = next(cmd for cmd in commands if cmd[1:3] == ["analyze", "perturb"])  # (after an extraction if no Lite0)
    assert study[study.index("--original") + 1] == f"{tmp_path}/runs/vsepp"
    # a study that began its own reference keeps it, whatever else the machine holds: its table's deltas must not
    # change reference between two runs of the bench (the evaluation cache of an --original alone does not count)
    own = tmp_path / "runs" / "perturb" / "vsepp" / "original"
    own.mkdir(parents=True)
    (own / "eval_test_1k.json").write_text("{}")
    assert bench.finished_table_run("vsepp", gpu) == f"{tmp_path}/runs/vsepp"
    (own / "study.json").write_text(json.dumps({"perturbation": "original"}))
    assert bench.finished_table_run("vsepp", gpu) is None
    assert bench.study_status("vsepp", gpu).startswith("no table yet; original: not started; shuffle: training")
    commands.clear()
    bench.run_perturb("vsepp", 1, gpu, jobs=2)
    assert "--original" not in next(cmd for cmd in commands if cmd[1:3] == ["analyze", "perturb"])


def test_an_ensemble_picked_on_dev_evaluates_test_once_with_the_pair_of_the_best_dev_rsum(bench, tmp_path,
                                                                                          monkeypatch):
    """The cross-family rows were fixed after test scores had been seen (docs/training.md): `ensemble_dev_pick` is the
    pair of its candidates with the best dev rsum; every pair's dev rsum is kept, so a rerun evaluates none again."""
    import dataclasses

    candidates = ["scan_i2t_lse", "mmca_alpha0_lite2", "vsepp"]  # (runs, as a row trained here would leave them)
    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"),
                              history=str(tmp_path / "history.csv"), on_cpu=True,
                              ensembles={**bench.GPU.ensembles, "ensemble_dev_pick": candidates},
                              dev_picked={"ensemble_dev_pick": candidates})
    for member in candidates:
        _fake_run(bench, gpu, member, epochs_done=bench.row_config(
            bench.base_preset(member, gpu), bench.schedule_of(member, gpu), []).train.epochs, with_best=True)
    dev = {"scan_i2t_lse+mmca_alpha0_lite2": 330.0, "scan_i2t_lse+vsepp": 310.0, "mmca_alpha0_lite2+vsepp": 320.0}
    result = {"image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "text_to_image": {"r1": 1.0, "r5": 2.0, "r10": 3.0},
              "rsum": 12.0, "protocol": "1k", "eval_seconds": 1.0}
    evaluated = []

    def evaluate(cmd, ranks=1):  # what `itmatch evaluate --json` leaves
        if cmd[1] != "evaluate":
            return
        split, out = cmd[cmd.index("--split") + 1], Path(cmd[cmd.index("--json") + 1])
        members = [Path(a).parent.name for a in cmd if a.endswith("/best")]
        evaluated.append((split, members))
        # a pair of global-cosine heads with an MMCA member is pruned (exact, fewer pairs); one with SCAN is not
        assert ("--prune" in cmd) == (set(members) == {"mmca_alpha0_lite2", "vsepp"})
        out.write_text(json.dumps({**result, "rsum": dev["+".join(members)] if split == "dev" else 12.0}))

    monkeypatch.setattr(bench, "run", evaluate)
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile=None: None)
    bench.run_row("ensemble_dev_pick", 2, profile=gpu)
    assert [members for split, members in evaluated if split == "dev"] == [m.split("+") for m in dev]
    assert evaluated[-1] == ("test", ["scan_i2t_lse", "mmca_alpha0_lite2"]) and len(evaluated) == 4
    recorded = json.loads((tmp_path / "runs" / "ensemble_dev_pick.dev_pairs.json").read_text())
    assert {key: entry["rsum"] for key, entry in recorded.items()} == dev
    from itmatch.engine.results import read_rows

    row = next(r for r in read_rows(tmp_path / "gpu.csv") if r["name"] == "ensemble_dev_pick")
    assert row["model"] == "scan_i2t_lse+mmca_alpha0"  # (the pair's presets)
    evaluated.clear()
    bench.run_row("ensemble_dev_pick", 2, profile=gpu)  # (again: the dev rsums are kept, test is evaluated again)
    assert evaluated == [("test", ["scan_i2t_lse", "mmca_alpha0_lite2"])]
    # the recall figure evaluates the same pair (it evaluated all the candidates as one ensemble)
    evaluated.clear()
    (tmp_path / "runs" / "ensemble_dev_pick.test.json").unlink()
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # (the figure's path; the runs' paths are absolute)
    bench.recall_figure(["ensemble_dev_pick"], 2, gpu)
    assert evaluated[0] == ("test", ["scan_i2t_lse", "mmca_alpha0_lite2"])
    # a tie goes to the first pair in the candidates' order, whatever the file's order; a stale pair counts not
    picks = tmp_path / "runs" / "ensemble_dev_pick.dev_pairs.json"

    def record(rsums):
        picks.write_text(json.dumps({key: {"rsum": rsum, "weights": dict.fromkeys(key.split("+"), "")}
                                     for key, rsum in rsums.items()}))

    record({"x+y": 400.0, "mmca_alpha0_lite2+vsepp": 330.0, **dev})
    assert bench.dev_pick("ensemble_dev_pick", gpu) == ["scan_i2t_lse", "mmca_alpha0_lite2"]
    del dev["scan_i2t_lse+vsepp"]
    record(dev)
    assert bench.dev_pick("ensemble_dev_pick", gpu) is None  # (a pair left: the row evaluates it first)
    # a member retrained since: its pairs' dev rsums were of other weights, and are evaluated again (those alone)
    dev["scan_i2t_lse+vsepp"] = 310.0
    record(dev)
    (tmp_path / "runs" / "vsepp" / "best" / "manifest.json").write_text(json.dumps(
        {"version": 2, "files": {"model.safetensors": {"bytes": 1, "sha256": "retrained"}}}))
    assert bench.dev_pick("ensemble_dev_pick", gpu) is None
    evaluated.clear()
    monkeypatch.setattr(bench, "ROOT", ROOT)  # (the schedule files' paths)
    bench.run_row("ensemble_dev_pick", 2, profile=gpu)
    assert [members for split, members in evaluated if split == "dev"] == [["scan_i2t_lse", "vsepp"],
                                                                          ["mmca_alpha0_lite2", "vsepp"]]
    assert json.loads(picks.read_text())["mmca_alpha0_lite2+vsepp"]["weights"]["vsepp"] == "retrained"


def test_a_gpu_row_evaluated_again_replaces_its_own_json(bench, tmp_path, monkeypatch, capsys):
    """The GPU table's evaluation wrote `--json RUNS/<row>.test.json` without --force, and `itmatch evaluate` keeps an
    existing file without it: a bench killed between the JSON and the row, or a row evaluated again, failed at every
    rerun (runs/flickr8k_gpu/vsepp.test.json here would have stopped `--row vsepp`)."""
    import dataclasses

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"), on_cpu=True)
    _fake_run(bench, gpu, "vsepp", epochs_done=30, with_best=True)
    (tmp_path / "runs" / "vsepp.test.json").write_text("{}")
    monkeypatch.setattr(bench, "DRY_RUN", True)
    bench.run_row("vsepp", 2, profile=gpu)
    evaluate = next(line for line in capsys.readouterr().out.splitlines() if " evaluate " in line).split()
    assert evaluate[evaluate.index("--json") + 1] == f"{tmp_path}/runs/vsepp.test.json" and "--force" in evaluate


def test_one_trainer_per_run_folder_the_second_waits_and_finds_it_trained(bench, tmp_path, monkeypatch, capsys):
    """Rows side by side may share a member (a row and its ensemble, a run and the row that continues it): the second
    bench started the same run with --force, which wipes the first's checkpoints under it. It now waits for the
    first's lock, then looks again, and trains nothing when the first finished the run."""
    import dataclasses
    import threading
    import time

    from filelock import FileLock

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"))
    _fake_run(bench, gpu, "vsepp", epochs_done=7, with_best=True)
    commands: list[list[str]] = []
    monkeypatch.setattr(bench, "run", lambda cmd, ranks=1: commands.append(cmd))
    monkeypatch.setattr(bench, "ensure_features", lambda data, profile=None: None)
    first = FileLock(tmp_path / "runs" / ".vsepp.lock")
    first.acquire()  # (the other bench, training vsepp)
    second = threading.Thread(target=bench.run_row, args=("vsepp", 2), kwargs={"train_only": True, "profile": gpu})
    second.start()
    said = ""
    deadline = time.monotonic() + 30
    while "being trained by another process" not in said and time.monotonic() < deadline:
        time.sleep(0.05)
        said += capsys.readouterr().out
    assert "runs/vsepp is being trained by another process; waiting for it" in said
    assert second.is_alive() and not commands
    (tmp_path / "runs" / "vsepp" / "last" / "state.json").write_text(json.dumps({"epoch": 30, "batch": 0}))
    first.release()  # the other bench finished the run
    second.join(timeout=30)
    assert not second.is_alive() and not commands  # nothing trained again


def test_a_row_evaluated_here_of_a_run_trained_elsewhere_names_both_machines(bench, tmp_path, capsys):
    """A run fetched from a GPU session and evaluated on this CPU was labelled with the CPU alone, and the GPU's row it
    replaced went without a word."""
    import dataclasses

    from itmatch.engine.results import DEVICE_HEADER, read_rows, write_rows

    cpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"), on_cpu=True)
    _fake_run(bench, cpu, "scan_i2t_lse", epochs_done=30, with_best=True)
    (tmp_path / "runs" / "scan_i2t_lse" / "best" / "state.json").write_text(
        json.dumps({"epoch": 30, "devices": ["NVIDIA H100 80GB HBM3"]}))
    write_rows(cpu.results, DEVICE_HEADER, [{**dict.fromkeys(DEVICE_HEADER, ""), "name": "scan_i2t_lse",
                                             "rsum": "283.3", "device": "NVIDIA H100 80GB HBM3"}])
    result = {"image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "text_to_image": {"r1": 1.0, "r5": 2.0, "r10": 3.0},
              "rsum": 12.0, "protocol": "1k", "eval_seconds": 1.0}
    (tmp_path / "scan.test.json").write_text(json.dumps(result))
    bench.write_device_row("scan_i2t_lse", "scan_i2t_lse", tmp_path / "scan.test.json", "cmd", cpu, threads=2,
                           members=["scan_i2t_lse"])
    device = read_rows(cpu.results)[0]["device"]
    assert device.startswith("CPU ") and device.endswith(", 2 threads; trained on NVIDIA H100 80GB HBM3")
    assert "it replaces the row from NVIDIA H100 80GB HBM3: rsum 283.3" in capsys.readouterr().out
    here = bench.device_name(cpu, 2)  # a run trained on this machine names it once
    assert bench.device_name(cpu, 2, [here.split(",")[0]]) == here


def test_the_recall_figure_never_draws_a_run_with_epochs_left(bench, tmp_path, monkeypatch):
    """`--recall --row X` while X trains evaluated its best/ of an epoch on the way and drew it under the row's name."""
    import dataclasses

    gpu = dataclasses.replace(bench.GPU, runs=str(tmp_path / "runs"), results=str(tmp_path / "gpu.csv"), on_cpu=True)
    _fake_run(bench, gpu, "vsepp", epochs_done=7, with_best=True)
    monkeypatch.setattr(bench, "run", lambda cmd, ranks=1: pytest.fail(f"ran {cmd}"))
    with pytest.raises(SystemExit, match="vsepp has epochs left to train; finish the row first"):
        bench.recall_figure(["vsepp"], 2, gpu)


def test_a_row_that_stops_with_a_message_does_not_stop_the_rows_after_it(bench, monkeypatch, capsys):
    """A row's own refusal (sys.exit: its run was trained with other settings, its dev pairs are missing) ended the
    whole bench there: the rows after it did not run and the pages were not rendered."""
    import sys

    ran, commands = [], []

    def run_row(row, *args, **kwargs):
        ran.append(row)
        if row == "vsepp":
            sys.exit("row vsepp: the run was trained with other settings")

    monkeypatch.setattr(sys, "argv", ["flickr8k.py", "--config", "gpu", "--device", "cpu", "--row", "vsepp",
                                      "--row", "meanpool"])
    monkeypatch.setattr(bench, "run_row", run_row)
    monkeypatch.setattr(bench, "run", lambda cmd, ranks=1: commands.append(cmd))
    monkeypatch.setattr(bench, "check_rows_resolve", lambda profile: None)
    assert bench.main() == 1
    assert ran == ["vsepp", "meanpool"] and commands[-1][-1] == "scripts/render_results.py"
    err = capsys.readouterr().err
    assert "row vsepp FAILED: row vsepp: the run was trained with other settings" in err
    assert "1 row(s) failed: vsepp" in err


def test_the_shipped_pick_weighs_every_shipped_model_each_on_the_features_of_the_row_it_was_shipped_from(bench):
    """`ensemble_dev_pick_shipped` is the dev pick over the models a user loads by name: a model shipped later is a
    candidate too (its card names its row, which says what features it reads), and none is trained again."""
    candidates = bench.GPU.dev_picked["ensemble_dev_pick_shipped"]
    assert sorted(candidates) == sorted(bench.shipped())
    assert all(bench.SHIPPED_MEMBERS[name] in bench.GPU.rows for name in candidates)
    members, datas = bench.row_members("ensemble_dev_pick_shipped", bench.GPU)
    reads = dict(zip(members, datas, strict=True))
    assert reads["mmca_alpha0_lite2_decay4-flickr8k"] == bench.DATA_LITE2 and reads["vsepp-flickr8k"] == bench.DATA
    assert bench.without_checkpoint(members, bench.GPU) == []
