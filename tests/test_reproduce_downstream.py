"""bench/reproduce.py --downstream on synthetic durable results (fast tier): the downstream jobs (the held-out
multiple-choice task through lm-evaluation-harness, one per row of DOWNSTREAM) are planned after their rows, re-run
with them, and their accuracy lands beside the row's perplexity on the page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import reproduce_store as store  # noqa: E402
from reproduce_corpus import DOWNSTREAM, DOWNSTREAM_TASK, HEADLINE, SCALES, Corpus  # noqa: E402
from reproduce_jobs import plan, valid  # noqa: E402
from reproduce_page import page, readme_lines  # noqa: E402
from reproduce_report import MISSING, collect, results_json  # noqa: E402
from test_reproduce_report import FINAL, fake_result  # noqa: E402

S = SCALES["tiny"]
ACC = {"dense": 0.30, "dense-4x": 0.35, "flat-4": 0.40, "dipaco-2x2": 0.45, "dipaco-2x2-private": 0.50,
       "dipaco-2x2-overlap": 0.42}


def fake(c: Corpus, job, fp: str) -> dict:
    if not job.name.startswith("downstream-"):
        return fake_result(c, job, fp)
    row = job.name.removeprefix("downstream-")
    evals = {"heldout_choice": {"task": "heldout_choice", **DOWNSTREAM_TASK, "questions": 40, "acc": ACC[row],
                                "acc_stderr": 0.07, "acc_norm": ACC[row] - 0.05, "acc_norm_stderr": 0.07,
                                "routing": "once", "requests_per_path": {"0-0": 160}},
             "heldout": {"methods": {{sp.name: sp for sp in c.specs()}[row].label: {"perplexity": FINAL[row]}}}}
    return {"fingerprint": fp, "job": job.name, "corpus": c.name, "record": {"row": row}, "rounds": [], "run_info": {},
            "evals": evals, "weights_sha256": f"weights of {row}"}


def simulate(c: Corpus, results: Path, out: Path) -> list:
    for _ in range(12):
        jobs = c.jobs()
        ready = [j for j in plan(jobs, results, out) if j.durable and j.fp and store.load(results, c.name, j.name, j.fp) is None]
        if not ready:
            return jobs
        for j in ready:
            store.save(results, c.name, j.name, fake(c, j, j.fp))
    raise AssertionError("planning did not converge")


@pytest.fixture
def corpus(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "x"}\n')
    c = Corpus("default", tmp_path / "out", S, data, tmp_path / "jobs")
    c.downstream = True
    return c


def test_downstream_jobs_follow_their_rows_and_land_on_the_page(corpus, tmp_path):
    out, results = tmp_path / "out", tmp_path / "jobs"
    jobs = {j.name: j for j in corpus.jobs()}
    # before the headline row can be chosen on validation, every candidate is scored
    assert {n for n in jobs if n.startswith("downstream-")} == {f"downstream-{r}" for r in {*DOWNSTREAM, *HEADLINE}}
    for row in DOWNSTREAM:
        job = jobs[f"downstream-{row}"]
        assert job.deps == [row] and job.needs == [row]
        spec = job.spec()
        assert spec["command"] is None and spec["run"].endswith(f"runs/{row}")
        assert [st["op"] for st in spec["steps"]] == ["eval", "downstream"]  # its own perplexity: the weights it scores
    assert corpus.shards_needed(["downstream-flat-4"]) == {"2x2", "4"}  # the flat mixture's router is in shards-4
    assert not any(n.startswith("downstream-") for n in (j.name for j in Corpus(
        "default", out, S, corpus.data, results).jobs()))  # only with --downstream

    jobs = simulate(corpus, results, out)
    assert plan(jobs, results, out) == []
    # once it is chosen (the private variant: lowest on validation), the other candidates are not scored
    assert corpus.downstream_rows() == [*DOWNSTREAM, "dipaco-2x2-private"]
    assert not any(j.name == "downstream-dipaco-2x2-overlap" for j in corpus.jobs())
    # a row lost with its run directory: it re-trains (and the start it continues from), its downstream job follows
    (results / "default" / "flat-4.json").unlink()
    assert {j.name for j in plan(corpus.jobs(), results, out)} == {"flat-4", "start", "downstream-flat-4"}

    jobs = simulate(corpus, results, out)
    corpus.valid = valid(jobs, results)["default"]
    res = collect(corpus)
    assert res["downstream"]["dipaco-2x2-private"]["acc"] == 0.50
    assert res["downstream"]["flat-4"]["perplexity"] == res["runs"]["flat-4"]["perplexity"]
    text = page(results_json([corpus], {"default": res}, "tiny", S), S, {}, "python bench/reproduce.py --downstream")
    table = text.split("Downstream (lm-evaluation-harness")[1].split("Expectations:")[0]
    assert "| DiPaCo 2x2, private embedding and blocks 0, 3 (headline) | 28.20 | 0.500 ± 0.070 | 0.450 ± 0.070 | 40 |" in table
    assert table.count("\n| ") == 2 + len(DOWNSTREAM) + 1 and MISSING not in table and "overlap" not in table

    # the rows' durable results hold their weights' hash: a downstream result on other weights (its row re-trained
    # on another machine) is marked, once trained weights agree it is not
    for row in DOWNSTREAM:
        f = results / "default" / f"{row}.json"
        f.write_text(f.read_text().replace('"fingerprint"', f'"weights_sha256": "weights of {row}", "fingerprint"', 1))
    other = results / "default" / "downstream-flat-4.json"
    elsewhere = other.read_text().replace("weights of flat-4", "weights trained elsewhere")
    other.write_text(elsewhere.replace(f'"perplexity": {FINAL["flat-4"]}', '"perplexity": 33.33'))
    text = page(results_json([corpus], {"default": collect(corpus)}, "tiny", S), S, {}, "x")
    table = text.split("Downstream (lm-evaluation-harness")[1].split("Expectations:")[0]
    # both columns of that row are of the re-trained weights; the note gives the main table's perplexity
    assert table.count("†") == 2 and "| 33.33† | 0.400 ± 0.070 | 0.350 ± 0.070 |" in table
    assert "The main table's perplexity: flat mixture, 4 paths" in table and f"{FINAL['flat-4']:.2f} (at most 23.4% apart)." in table
    # the README's line for the corpus gives the headline's accuracy beside dense's
    line = readme_lines(results_json([corpus], {"default": collect(corpus)}, "tiny", S))
    assert "held-out multiple choice (lm-evaluation-harness) 0.500 ± 0.070 vs dense 0.300 ± 0.070" in " ".join(line.replace("\u00a0", " ").split())

    (results / "default" / "downstream-dense.json").unlink()  # a downstream result missing: its row says so
    plan(jobs, results, out)  # (fingerprints)
    corpus.valid = valid(jobs, results)["default"]
    text = page(results_json([corpus], {"default": collect(corpus)}, "tiny", S), S, {}, "x")
    assert f"| dense (same steps as one trainee) | 30.00 | {MISSING} | | |" in text
