"""bench/reproduce.py at its `tiny` scale: every stage runs for real (shards, the start and its lr pilot, the
outer-optimizer grid, every row with its evaluations, today's routing, the report), then a new session (run
directories gone, one durable result lost) re-trains only what is missing, and --report-only writes the page from
the durable results alone."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bench/reproduce.py in a subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "reproduce.py"
IDS = {"diloco_below_dense", "dipaco_below_dense_5pct", "dipaco_near_dense_px", "dipaco_4x4_below_2x2",
       "every64_below_once", "discriminative_not_worse", "fourbit_within_1pct", "bytes_400x"}
ROWS = {"dense", "dense-4x", "diloco-iid", "diloco-kmeans", "flat-4", "dipaco-2x2", "dipaco-2x2-private", "dipaco-2x2-overlap",
        "dipaco-2x2-paper", "dipaco-2x2-disc", "dipaco-4x4", "stream-fp32", "stream-4bit", "bytes-4bit-h100"}
HEADLINE = {"dipaco-2x2", "dipaco-2x2-private", "dipaco-2x2-overlap"}


def reproduce(*args: str, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def plans(out: Path) -> list[dict]:
    return [e for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if e["event"] == "plan"]


def test_reproduce_tiny_durable_results_resume_and_report_only(corpus_file, tmp_path):
    out, results, page, readme = tmp_path / "out", tmp_path / "jobs", tmp_path / "docs" / "RESULTS.md", tmp_path / "README.md"
    readme.write_text("# dipaco\n\n<!-- results:begin -->\nold figures\n<!-- results:end -->\n\nMore prose.\n")
    base = ["--scale", "tiny", "--corpus", "default", "--data", str(corpus_file), "--jobs", "2", "--results", str(results)]
    reproduce(*base, "--out", str(out), "--page", str(page), "--readme", str(readme), timeout=1200)

    res = json.loads((out / "results.json").read_text())
    c = res["corpora"]["default"]
    runs = c["runs"]
    assert set(runs) == ROWS and res["missing"] == {"default": []}
    assert runs.pop("bytes-4bit-h100")["bytes_only"]
    for name, r in runs.items():
        assert 1 < r["perplexity"] < 1e4, name
        assert r["parameters_per_path"] == runs["dense"]["parameters_per_path"]  # the same path size everywhere
        assert r["scored_tokens"] == c["scored_tokens"]  # ... and the same held-out tokens
    # the paper's recipe: private modules cost parameters (a private embedding per path: more than the flat mixture,
    # which shares its embedding, at this vocabulary), overlap costs none
    assert runs["dipaco-2x2-private"]["parameters_total"] > runs["dipaco-2x2"]["parameters_total"]
    assert runs["dipaco-2x2-overlap"]["parameters_total"] == runs["dipaco-2x2"]["parameters_total"]
    # every setting chosen on validation data, the headline row too
    assert c["pretrain"]["lr"] in (2e-3, 5e-3) and len(c["pretrain"]["curve"]) == 2
    assert all(g["val_perplexity"] for g in c["outer_grid"]) and runs["dipaco-2x2-paper"]["outer"] == [0.7, 0.9]
    val = {n: runs[n]["val_perplexity"] for n in HEADLINE}
    assert c["headline"]["run"] == min(val, key=val.get) and c["headline"]["chosen_on_validation"] == val
    # today's routing: the run's saved once rule, every-16 by the rule chosen on the router documents, its compute,
    # its one-path variant
    assert set(c["routing"]) == {"flat-4", "dipaco-2x2", "dipaco-2x2-private", "dipaco-2x2-overlap", "dipaco-2x2-disc", "dipaco-4x4"}
    for name, rt in c["routing"].items():
        assert rt["once_rule"] and rt["every_rule"] and rt["one_path_rule"], name
        assert rt["forward_passes"] == (rt["paths"] if rt["every_rule"].startswith("lagged-loss") else 1), name
        assert rt["one_path"] is not None and rt["oracle"] <= rt["once"] + 1e-9, name
    # the explaining experiment: every round of dense, flat, DiPaCo 2x2 and its private variant
    assert all(c["lead"][n]["rounds"] == [0, 1, 2] for n in ("dense", "flat-4", "dipaco-2x2", "dipaco-2x2-private"))
    assert {e["id"] for e in res["expectations"]} == IDS
    durable = {f.stem for f in (results / "default").glob("*.json")}
    assert durable == ROWS | {"start", "start-lr0.002", "start-lr0.005", "pilot-outer-lr0.7-m0.9", "pilot-outer-lr1-m0"}
    for f in ("lead_default.png", "rounds_default.png", "pretrain_default.png", "results.json"):
        assert (page.parent / "results" / f).is_file(), f
    text = page.read_text()
    assert "| DiPaCo 2x2, private embedding and blocks 0, 3" in text and "forward passes" in text and "not yet run |" not in text
    assert "old figures" not in readme.read_text() and readme.read_text().endswith("<!-- results:end -->\n\nMore prose.\n")

    # a new session: the run directories are gone, and one durable result with them. Only that row re-trains, and
    # the start, whose weights it needs (the same bits: the row measures what it measured before)
    shutil.rmtree(out)
    (results / "default" / "dipaco-2x2-private.json").unlink()
    reproduce(*base, "--out", str(out), timeout=600)
    assert set(plans(out)[0]["to_run"]) == {"default:start", "default:dipaco-2x2-private"}
    assert sorted(p.name for p in (out / "default").glob("shards-*")) == ["shards-2x2"]  # only what they read
    again = json.loads((out / "results.json").read_text())["corpora"]["default"]["runs"]
    assert again["dipaco-2x2-private"]["perplexity"] == pytest.approx(runs["dipaco-2x2-private"]["perplexity"], rel=1e-6)
    assert again["dense"]["perplexity"] == runs["dense"]["perplexity"]

    # report only: nothing runs (no shards), a row whose result is missing says so
    (results / "default" / "dipaco-4x4.json").unlink()
    only = reproduce(*base, "--out", str(tmp_path / "o2"), "--report-only", timeout=300)
    assert "[jobs]" not in only.stdout and not (tmp_path / "o2" / "default").exists()
    text = (tmp_path / "o2" / "RESULTS.md").read_text()
    assert "| DiPaCo 4x4 | not yet run |" in text and "| DiPaCo 2x2 |" in text


def test_reproduce_without_corpus_says_so(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--scale", "tiny", "--corpus", "shared", "--data", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not found" in proc.stderr
