"""bench/reproduce.py at its `tiny` scale: every stage runs for real (shards, pretrain, the six runs,
the evaluations, the report), so the results page cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "reproduce.py"


def test_reproduce_tiny_end_to_end_and_resume(corpus_file, tmp_path):
    out, page = tmp_path / "out", tmp_path / "docs" / "RESULTS.md"
    page.parent.mkdir()
    page.write_text("# Results\n\nHand-written analysis.\n\n<!-- reproduce:begin -->\nold\n<!-- reproduce:end -->\n\nMore prose.\n")
    cmd = [sys.executable, str(SCRIPT), "--scale", "tiny", "--data", str(corpus_file), "--out", str(out), "--jobs", "2",
           "--page", str(page)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    res = json.loads((out / "results.json").read_text())
    assert set(res["runs"]) == {"dense", "dense-2x", "diloco-4", "flat-4", "dipaco-2x2", "dipaco-2x2-streaming"}
    for name, r in res["runs"].items():
        assert 1 < r["perplexity"] < 1e4, name
        assert r["parameters_per_path"] == res["runs"]["dense"]["parameters_per_path"]  # the same path size everywhere
        assert r["scored_tokens"] == res["scored_tokens"]  # ... and the same held-out tokens
    assert res["runs"]["flat-4"]["parameters_total"] > res["runs"]["dipaco-2x2"]["parameters_total"] > res["runs"]["dense"]["parameters_total"]
    extras = res["runs"]["dipaco-2x2"]["extra_rows"]
    assert {"DiPaCo 2x2 every-16", "DiPaCo 2x2 early-stop", "DiPaCo 2x2 oracle", "DiPaCo 2x2 random"} <= set(extras)
    assert extras["DiPaCo 2x2 oracle"]["perplexity"] <= res["runs"]["dipaco-2x2"]["perplexity"]
    assert len(res["expectations"]) >= 7 and all(isinstance(e["held"], bool) for e in res["expectations"])
    assert res["curves"]["dense, 2x steps (compute-matched)"]["steps"][-1] == 2 * res["curves"]["DiPaCo 2x2"]["steps"][-1]
    assert (out / "perplexity_rounds.png").stat().st_size > 10_000

    text = page.read_text()  # the generated block replaced, the prose kept
    assert text.startswith("# Results\n\nHand-written analysis.") and text.rstrip().endswith("More prose.")
    assert "| DiPaCo 2x2 |" in text and "old" not in text and (page.parent / "results" / "perplexity_rounds.png").is_file()

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # everything is done: nothing reruns
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[jobs] 0 to run" in again.stdout
    assert json.loads((out / "results.json").read_text())["runs"]["dipaco-2x2"]["perplexity"] == res["runs"]["dipaco-2x2"]["perplexity"]


def test_reproduce_without_corpus_says_so(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--scale", "tiny", "--data", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not found" in proc.stderr
