"""Results CSV: exact header, unique names, rendering; the CLI's help and model list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from itmatch.cli import main
from itmatch.engine.results import (
    CLAIMS_HEAD,
    HEADER,
    history_rows,
    markdown_tables,
    read_rows,
    render_history_markdown,
    render_markdown,
    render_views,
    replace_history,
    result_row,
    upsert_row,
    view_pages,
)
from itmatch.errors import DataError, OverwriteError

RESULT = {"protocol": "1k", "rsum": 123.45, "eval_seconds": 1.234,
          "image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "text_to_image": {"r1": 4.0, "r5": 5.0, "r10": 6.0}}


def test_header_is_exactly_the_design(tmp_path):
    path = tmp_path / "flickr8k.csv"
    upsert_row(path, result_row("scan_t2i_avg", "scan_t2i_avg", "flickr8k", RESULT, "itmatch evaluate x"))
    assert path.read_text().splitlines()[0] == ",".join(HEADER) == (
        "name,model,dataset,protocol,image_to_text_r1,image_to_text_r5,image_to_text_r10,text_to_image_r1,"
        "text_to_image_r5,text_to_image_r10,rsum,eval_seconds,command")
    with pytest.raises(OverwriteError):
        upsert_row(path, result_row("scan_t2i_avg", "m", "d", RESULT, "c"))
    upsert_row(path, result_row("scan_t2i_avg", "m", "d", RESULT, "c2"), force=True)
    rows = read_rows(path)
    assert len(rows) == 1 and rows[0]["command"] == "c2" and rows[0]["rsum"] == "123.5"
    md = render_markdown(path)
    assert "| scan_t2i_avg | 1k | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 123.5 | 20.6 | 1.2 |" in md  # mR = rsum / 6


def test_a_rows_other_seeds_are_summed_up_with_their_spread(tmp_path):
    """`<row>_seedN` rows beside their row: the rendered table states each group's rsums, mean and spread (the
    issue's "two seeds for the headline rows, state the spread"), computed from the CSV, never typed."""
    path = tmp_path / "flickr8k_gpu.csv"
    for name, rsum, protocol in [("vsepp", 245.9, "1k"), ("oan", 261.2, "1k"), ("vsepp_seed1", 249.7, "1k"),
                                 ("vsepp_seed2", 247.0, "1k"), ("scan_seed1", 250.0, "1k"),  # (no scan row)
                                 ("oan_seed1", 260.0, "5k")]:  # (another protocol: not a seed of oan's 1k row)
        upsert_row(path, result_row(name, name, "flickr8k", {**RESULT, "rsum": rsum, "protocol": protocol}, "c",
                                    device="NVIDIA H100"))
    md = render_markdown(path)
    assert "| vsepp | 3 | 245.9 / 249.7 / 247.0 | 247.5 | 3.8 |" in md
    seeds = md.split("## Seeds")[1].split("Commands")[0]
    assert [line.split(" | ")[0] for line in seeds.splitlines() if line.startswith("| ")][1:] == ["| vsepp"]
    upsert_row(tmp_path / "other.csv", result_row("vsepp", "vsepp", "flickr8k", RESULT, "c"))
    assert "## Seeds" not in render_markdown(tmp_path / "other.csv")


def test_a_tables_about_file_is_its_pages_preface(tmp_path):
    """What a reader needs before the numbers (where rows ran, what to read them with) sits above the table."""
    path = tmp_path / "flickr8k_gpu.csv"
    upsert_row(path, result_row("vsepp", "vsepp", "flickr8k", RESULT, "c", device="NVIDIA H100"))
    assert "Rows ran on" not in render_markdown(path)
    (tmp_path / "flickr8k_gpu.about.md").write_text("Rows ran on two machines.\n")
    md = render_markdown(path)
    assert md.index("do not edit by hand") < md.index("Rows ran on two machines.") < md.index("| name |")


def _add_rows(path: str, worker: int, count: int) -> None:
    for i in range(count):
        upsert_row(path, result_row(f"w{worker}_{i}", "m", "d", RESULT, "c"))


def test_evaluations_writing_one_results_file_at_once_lose_no_row(tmp_path):
    """Processes appending rows side by side (two bench jobs finishing together) keep every row."""
    import multiprocessing

    path = str(tmp_path / "flickr8k.csv")
    context = multiprocessing.get_context("spawn")  # (no fork of a process that may hold torch threads)
    workers = [context.Process(target=_add_rows, args=(path, w, 25)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    assert sorted(r["name"] for r in read_rows(path)) == sorted(f"w{w}_{i}" for w in range(4) for i in range(25))


def test_foreign_csv_is_rejected(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="x.csv:1: unexpected header"):
        read_rows(path)


def test_cli_help_and_models(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "evaluate" in capsys.readouterr().out
    assert main(["models"]) == 0
    assert "scan_t2i_avg" in capsys.readouterr().out


def test_results_views_in_a_page_are_filled_from_the_csv(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, rsum in (("oan", 225.0), ("oan_no_attn", 229.3)):
        upsert_row(results / "flickr8k.csv", result_row(name, name, "flickr8k", {**RESULT, "rsum": rsum}, "c"))
    page = tmp_path / "oan.md"
    page.write_text("# OAN\n\n<!-- results: flickr8k oan_no_attn oan oan_bilstm -->\nstale\n<!-- results: end -->\n"
                    "\ntext between\n\n<!-- results: flickr8k oan -->\n<!-- results: end -->\n")
    text = render_views(page, results)
    first, second = text.split("text between")
    assert "stale" not in text and first.index("| oan_no_attn |") < first.index("| oan |")  # the order named
    assert "| oan_no_attn | 1k | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 229.3 | 38.2 | 1.2 |" in first
    assert first.index("| oan |") < first.index("| oan_bilstm | not run yet |")
    assert second.count("| oan |") == 1 and "oan_no_attn" not in second
    page.write_text(text)
    assert render_views(page, results) == text  # rendering is idempotent
    page.write_text("a\n<!-- results: coco oan -->\n<!-- results: end -->\n")
    with pytest.raises(DataError, match=r"oan.md:2: results view names coco.csv, which does not exist"):
        render_views(page, results)


def test_a_results_view_of_a_table_with_devices_names_where_each_row_ran(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    upsert_row(results / "flickr8k_gpu.csv", result_row("vsepp", "vsepp", "flickr8k", RESULT, "c", device="CPU x"))
    page = tmp_path / "README.md"
    page.write_text("<!-- results: flickr8k_gpu vsepp scan_i2t_lse -->\n<!-- results: end -->\n")
    text = render_views(page, results)
    assert "| rsum | mR | eval s | device |" in text
    assert "| vsepp | 1k | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 123.5 | 20.6 | 1.2 | CPU x |" in text
    assert "| scan_i2t_lse | not run yet | | | | | | | | | | |" in text  # (one blank cell per column)


def test_claims_view_checks_the_papers_orderings_and_the_goals_against_the_table(tmp_path):
    """`<!-- claims: CSV a>b c>=275.2 -->`: each ordering or goal with both sides' rsum, the margin and whether it
    holds, flagged when the margin is within a side's seed spread (a side of one seed: the table's largest),
    "not run yet" for a row not in the table; a malformed claim names the page's line."""
    results = tmp_path / "results"
    results.mkdir()
    for name, rsum in (("scan_i2t_lse", 283.3), ("vsepp", 245.9), ("vsepp_seed1", 249.7), ("oan", 261.2),
                       ("scan_t2i_avg", 256.3), ("oan_bilstm", 259.0)):
        upsert_row(results / "flickr8k_gpu.csv", result_row(name, name, "flickr8k", {**RESULT, "rsum": rsum}, "c",
                                                           device="NVIDIA H100"))
    page = tmp_path / "training.md"
    page.write_text("<!-- claims: flickr8k_gpu scan_i2t_lse>vsepp oan>=scan_t2i_avg vsepp>=248 save_asa>save_dsa "
                    "scan_i2t_lse>=300 oan>oan_bilstm -->\n<!-- claims: end -->\n")
    lines = render_views(page, results).splitlines()
    assert lines[1:3] == CLAIMS_HEAD
    assert lines[3:9] == [
        "| scan_i2t_lse > vsepp | 283.3 | 245.9 | +37.4 | holds; one seed: scan_i2t_lse |",
        "| oan ≥ scan_t2i_avg | 261.2 | 256.3 | +4.9 | holds; one seed: oan, scan_t2i_avg |",
        "| vsepp ≥ 248 | 245.9 | 248.0 (goal) | −2.1 | does not hold, within the seed spread (3.8) |",
        "| save_asa > save_dsa | | | | save_asa, save_dsa not run yet |",
        "| scan_i2t_lse ≥ 300 | 283.3 | 300.0 (goal) | −16.7 | does not hold; one seed: scan_i2t_lse |",
        # (two rows of one seed each: as uncertain as the widest spread the table measured)
        "| oan > oan_bilstm | 261.2 | 259.0 | +2.2 | holds, within the table's largest seed spread (3.8); one seed: "
        "oan, oan_bilstm |"]
    # a side whose run kept its last epoch (the training history beside the table says so) may not have converged
    metrics = tmp_path / "oan.jsonl"
    metrics.write_text("".join(json.dumps({"epoch": e, "hardest": True, "lr": 5e-4, "batches": 3,
                                           "train_seconds": 1.0, "val_rsum": v}) + "\n"
                               for e, v in ((1, 200.0), (2, 250.0))))
    replace_history(results / "training" / "flickr8k_gpu.csv", "oan", history_rows("oan", metrics))
    assert render_views(page, results).splitlines()[8] == (
        "| oan > oan_bilstm | 261.2 | 259.0 | +2.2 | holds, within the table's largest seed spread (3.8); one seed: "
        "oan, oan_bilstm; kept its last epoch (maybe not converged): oan |")
    # a group of seeds with a run still rising measures that run's movement, not the seeds: it keeps its own
    # spread but does not set the one-seed rows' (vsepp_seed1 kept its last epoch: the largest left is none); the
    # claim on vsepp names it, since its spread is the yardstick
    replace_history(results / "training" / "flickr8k_gpu.csv", "vsepp_seed1", history_rows("vsepp_seed1", metrics))
    lines = render_views(page, results).splitlines()
    assert lines[5] == ("| vsepp ≥ 248 | 245.9 | 248.0 (goal) | −2.1 | does not hold, within the seed spread (3.8); "
                        "kept its last epoch (maybe not converged): vsepp_seed1 |")
    # a one-seed side beside a side whose own spread is the wider: the yardstick is that side's spread, so named
    page.write_text("<!-- claims: flickr8k_gpu oan>vsepp -->\n<!-- claims: end -->\n")
    upsert_row(results / "flickr8k_gpu.csv", result_row("oan", "oan", "flickr8k", {**RESULT, "rsum": 248.0}, "c",
                                                       device="NVIDIA H100"), force=True)
    assert render_views(page, results).splitlines()[3] == (
        "| oan > vsepp | 248.0 | 245.9 | +2.1 | holds, within the seed spread (3.8); one seed: oan; kept its last "
        "epoch (maybe not converged): oan, vsepp_seed1 |")
    assert lines[8] == ("| oan > oan_bilstm | 261.2 | 259.0 | +2.2 | holds; one seed: oan, oan_bilstm; kept its last "
                        "epoch (maybe not converged): oan |")
    page.write_text("a\n<!-- claims: flickr8k_gpu oan>=scan_t2i_avg oan=vsepp -->\n<!-- claims: end -->\n")
    with pytest.raises(DataError, match=r"training.md:2: claim 'oan=vsepp' is not ROW>ROW"):
        render_views(page, results)


def test_versus_view_shows_differences_from_its_first_row(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, rsum, seconds in (("mmca", 250.0, 9000.0), ("mmca_rerank20", 247.5, 200.0)):
        result = {**RESULT, "rsum": rsum, "eval_seconds": seconds}
        upsert_row(results / "flickr8k.csv", result_row(name, name, "flickr8k", result, "c"))
    page = tmp_path / "mmca.md"
    page.write_text("<!-- versus: flickr8k mmca mmca_rerank20 mmca_rerank50 -->\n<!-- versus: end -->\n"
                    "<!-- versus: flickr8k mmca_h512 mmca_rerank20 -->\n<!-- versus: end -->\n")
    text = render_views(page, results)
    assert "| mmca | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 250.0 | 9000.0 | 1× |" in text
    assert "| mmca_rerank20 | +0.0 | +0.0 | +0.0 | +0.0 | +0.0 | +0.0 | −2.5 | 200.0 | 45.0× |" in text
    assert "| mmca_rerank50 | not run yet |" in text
    # no reference row yet: the others keep their own values and no speed-up
    assert "| mmca_h512 | not run yet |" in text
    assert "| mmca_rerank20 | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 247.5 | 200.0 | – |" in text


def test_committed_tables_and_views_match_their_csv():
    """docs/results/*.md and the results views of docs/*.md and the README are what scripts/render_results.py writes:
    a number typed by hand, or a CSV row added without re-rendering, fails here."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    tables = markdown_tables(docs / "results")
    assert {p.name for p, _ in tables} >= {"flickr8k.csv"} and any(p.parent.name == "training" for p, _ in tables)
    for csv_path, render in tables:
        assert csv_path.with_suffix(".md").read_text(encoding="utf-8") == render(csv_path), (
            f"{csv_path.with_suffix('.md')} is stale: run python scripts/render_results.py")
    pages = view_pages(docs)
    assert docs.parent / "README.md" in pages
    for page in pages:
        assert render_views(page, docs / "results") == page.read_text(encoding="utf-8"), (
            f"the results views of {page} are stale: run python scripts/render_results.py")


def _epoch(epoch: int, rsum: float, hardest: bool, **extra) -> str:
    return json.dumps({"epoch": epoch, "val_rsum": rsum, "lr": 0.0005, "hardest": hardest, "mean_loss": 1.0,
                       "train_seconds": 100.4 * epoch, "batches": 234, **extra}) + "\n"


def test_training_history_from_a_run_log(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # step lines are skipped; a resumed run wrote epoch 2 twice (the last wins); the first best is kept,
    # as the trainer keeps `best` only on a strictly higher dev rsum
    metrics.write_text(json.dumps({"step": 20, "epoch": 0, "loss": 3.0, "lr": 0.0005}) + "\n"
                       + _epoch(1, 150.0, False) + _epoch(2, 99.0, True)
                       + _epoch(2, 210.0, True, train_cpu_seconds=190.2)
                       + _epoch(3, 210.0, True, train_cpu_seconds=95.0))
    rows = history_rows("oan", metrics)
    assert [(r["epoch"], r["dev_rsum"], r["selected"]) for r in rows] == [("1", "150.0", ""), ("2", "210.0", "yes"),
                                                                         ("3", "210.0", "")]
    assert rows[0]["train_cpu_seconds"] == "" and rows[1]["train_cpu_seconds"] == "190"  # never guessed

    history = tmp_path / "training" / "flickr8k.csv"
    replace_history(history, "oan", rows)
    replace_history(history, "vsepp", history_rows("vsepp", metrics)[:1])
    replace_history(history, "oan", rows[:2])  # retrained: its old lines go, its place in the file stays
    assert [(r["name"], r["epoch"]) for r in read_rows(history, list(rows[0]))] == [("oan", "1"), ("oan", "2"),
                                                                                   ("vsepp", "1")]
    md = render_history_markdown(history)
    assert "| oan | 1 | sum | 0.0005 | 234 | 100 | - | 150.0 |  |" in md
    assert "| oan | 2 | hardest | 0.0005 | 234 | 201 | 190 | 210.0 | best |" in md

    page = tmp_path / "doc.md"
    page.write_text("<!-- training: flickr8k vsepp sman -->\nstale\n<!-- training: end -->\n")
    text = render_views(page, tmp_path)
    assert "stale" not in text and text.endswith("<!-- training: end -->\n")
    assert "| vsepp | 1 | sum |" in text and "| sman | not run yet | | | | | | | |" in text
    with pytest.raises(DataError, match="training view names coco.csv"):
        page.write_text("<!-- training: coco vsepp -->\n<!-- training: end -->\n")
        render_views(page, tmp_path)


def test_gpu_table_has_the_design_header_plus_the_device(tmp_path):
    """docs/results/<dataset>_gpu.csv: the same schema plus `device`; a row with and one without a device
    cannot share a file; the page shows the device."""
    gpu, cpu = tmp_path / "flickr8k_gpu.csv", tmp_path / "flickr8k.csv"
    upsert_row(gpu, result_row("scan_i2t_lse", "scan_i2t_lse", "flickr8k", RESULT, "c", device="NVIDIA H100"))
    assert gpu.read_text().splitlines()[0] == ",".join(HEADER) + ",device"
    assert read_rows(gpu)[0]["device"] == "NVIDIA H100"
    assert "| scan_i2t_lse | 1k | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 123.5 | 20.6 | 1.2 | NVIDIA H100 |" in \
        render_markdown(gpu)
    with pytest.raises(DataError, match="lacks a device"):
        upsert_row(gpu, result_row("vsepp", "vsepp", "flickr8k", RESULT, "c"))
    upsert_row(cpu, result_row("vsepp", "vsepp", "flickr8k", RESULT, "c"))
    with pytest.raises(DataError, match="has a device"):
        upsert_row(cpu, result_row("scan", "scan", "flickr8k", RESULT, "c", device="NVIDIA H100"))
    assert "device" not in render_markdown(cpu)


def test_an_empty_gpu_table_keeps_its_device_schema(tmp_path):
    """The committed header-only docs/results/flickr8k_gpu.csv renders with its device column and takes only
    rows with a device."""
    from itmatch.engine.results import DEVICE_HEADER, write_rows

    gpu = tmp_path / "flickr8k_gpu.csv"
    write_rows(gpu, DEVICE_HEADER, [])
    assert "| eval s | device |" in render_markdown(gpu)
    with pytest.raises(DataError, match="lacks a device"):
        upsert_row(gpu, result_row("vsepp", "vsepp", "flickr8k", RESULT, "c"))
    upsert_row(gpu, result_row("vsepp", "vsepp", "flickr8k", RESULT, "c", device="NVIDIA H100"))
    assert [r["device"] for r in read_rows(gpu)] == ["NVIDIA H100"]


def test_rows_whose_run_kept_its_last_epoch_are_named_under_the_table(tmp_path):
    """A row whose run's dev rsum was still rising at its last epoch (the epoch kept) may not have converged; the
    page says so from the training history beside the table, and names no row whose run peaked earlier."""
    path = tmp_path / "flickr8k_gpu.csv"
    for name in ("rising", "peaked", "no_history"):
        upsert_row(path, result_row(name, name, "flickr8k", RESULT, "c", device="NVIDIA H100"))
    assert "Kept their last epoch" not in render_markdown(path)  # (no history yet: nothing to say)
    history = tmp_path / "training" / "flickr8k_gpu.csv"
    for name, dev in (("rising", [100.0, 150.0, 174.2]), ("peaked", [100.0, 250.0, 240.0])):
        metrics = tmp_path / f"{name}.jsonl"
        metrics.write_text("".join(json.dumps({"epoch": e, "hardest": True, "lr": 2e-4, "batches": 3,
                                               "train_seconds": 1.0, "val_rsum": v}) + "\n"
                                   for e, v in enumerate(dev, 1)))
        replace_history(history, name, history_rows(name, metrics))
    notice = [line for line in render_markdown(path).splitlines() if line.startswith("**Kept their last epoch**")]
    assert len(notice) == 1 and "`rising` (epoch 3)" in notice[0]
    assert "peaked" not in notice[0] and "no_history" not in notice[0]
