"""bench/reproduce.py at its `tiny` scale: every stage runs for real (shards, the start and its lr pilot, the
outer-optimizer grid, every row, the best DiPaCo run's routings, the report), so the results page cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bench/reproduce.py in a subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "reproduce.py"
IDS = {"diloco_below_dense", "dipaco_below_dense_5pct", "dipaco_near_dense_px", "dipaco_4x4_below_2x2",
       "every64_below_once", "discriminative_not_worse", "fourbit_within_1pct", "bytes_400x"}


def test_reproduce_tiny_end_to_end_and_resume(corpus_file, tmp_path):
    out, page = tmp_path / "out", tmp_path / "docs" / "RESULTS.md"
    page.parent.mkdir()
    page.write_text("# Results\n\nHand-written analysis.\n\n<!-- reproduce:begin -->\nold\n<!-- reproduce:end -->\n\nMore prose.\n")
    cmd = [sys.executable, str(SCRIPT), "--scale", "tiny", "--corpus", "default", "--data", str(corpus_file),
           "--out", str(out), "--jobs", "2", "--page", str(page)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    res = json.loads((out / "results.json").read_text())
    c = res["corpora"]["default"]
    assert set(c["runs"]) == {"dense", "dense-4x", "diloco-iid", "diloco-kmeans", "flat-4", "dipaco-2x2", "dipaco-2x2-paper",
                              "dipaco-2x2-disc", "dipaco-4x4", "stream-fp32", "stream-4bit", "bytes-4bit-h100"}
    assert c["runs"].pop("bytes-4bit-h100")["bytes_only"]
    for name, r in c["runs"].items():
        assert 1 < r["perplexity"] < 1e4, name
        assert r["parameters_per_path"] == c["runs"]["dense"]["parameters_per_path"]  # the same path size everywhere
        assert r["scored_tokens"] == c["scored_tokens"]  # ... and the same held-out tokens
    runs = c["runs"]
    assert runs["dipaco-4x4"]["parameters_total"] > runs["dipaco-2x2"]["parameters_total"] > runs["dense"]["parameters_total"]
    assert runs["dense-4x"]["steps_per_trainee"] == 4 * runs["dense"]["steps_per_trainee"]
    # the start, its lr pilot, the outer grid: every choice was made on validation data and is recorded
    assert c["pretrain"]["lr"] in (2e-3, 5e-3) and c["pretrain_tokens_per_param"] > 0 and len(c["pretrain"]["curve"]) == 2
    assert len(c["outer_grid"]) == 2 and all(g["val_perplexity"] for g in c["outer_grid"])
    assert c["outer_chosen"] == min(([g["lr"], g["momentum"]] for g in c["outer_grid"]),
                                    key=lambda lm: next(g["val_perplexity"] for g in c["outer_grid"] if [g["lr"], g["momentum"]] == lm))
    assert runs["dipaco-2x2-paper"]["outer"] == [0.7, 0.9] and runs["dipaco-2x2"]["outer"] == c["outer_chosen"]
    best = c["best_dipaco"]
    assert best["run"] in {n for n in runs if n.startswith(("dipaco", "stream"))}
    assert {"once", "every-16", "oracle", "random", "early-stop", "mixture-2"} <= set(best["rows"])
    assert "chosen on the router documents" in best["rows"]["every-16"]["routing"]
    assert best["rows"]["window-oracle-16"]["perplexity"] <= best["rows"]["every-16"]["perplexity"]
    assert best["rows"]["oracle"]["perplexity"] <= best["rows"]["once"]["perplexity"]
    # every expectation id is there for the corpus, with a verdict or "pending" (tiny runs streaming in one process:
    # no bytes cross a wire)
    assert {e["id"] for e in res["expectations"]} == IDS and all(e["corpus"] == "default" for e in res["expectations"])
    assert all(e["held"] in (True, False, None) for e in res["expectations"])
    assert res["outer_rounds"] == 2 and res["pretrain_tokens_per_param"]["default"] == c["pretrain_tokens_per_param"]
    assert (out / "rounds_default.png").stat().st_size > 10_000 and (out / "pretrain_default.png").stat().st_size > 5_000

    text = page.read_text()  # the generated block replaced, the prose kept
    assert text.startswith("# Results\n\nHand-written analysis.") and text.rstrip().endswith("More prose.")
    assert "| DiPaCo 2x2 |" in text and "old" not in text and (page.parent / "results" / "rounds_default.png").is_file()

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # everything is done: nothing reruns
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[jobs] 0 to run" in again.stdout
    assert json.loads((out / "results.json").read_text())["corpora"]["default"]["runs"]["dipaco-2x2"]["perplexity"] == \
        runs["dipaco-2x2"]["perplexity"]


def test_reproduce_without_corpus_says_so(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--scale", "tiny", "--corpus", "shared", "--data", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not found" in proc.stderr
