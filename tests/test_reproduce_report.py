"""bench/reproduce.py's planner and report on synthetic durable results (fast tier): which jobs run, which are
skipped, and the page, README lines and expectations written from the results alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import reproduce_store as store  # noqa: E402
from reproduce_corpus import CURVES, HEADLINE, SCALES, Corpus  # noqa: E402
from reproduce_jobs import plan, valid  # noqa: E402
from reproduce_page import README_BEGIN, README_END, page, readme_lines, write_readme  # noqa: E402
from reproduce_report import MISSING, collect, results_json  # noqa: E402

S = SCALES["tiny"]
# final held-out perplexity per row; the private variant is best on validation, so it is the headline
FINAL = {"dense": 30.0, "dense-4x": 28.0, "diloco-iid": 29.5, "diloco-kmeans": 30.5, "flat-4": 27.0, "dipaco-2x2": 29.0,
         "dipaco-2x2-private": 28.2, "dipaco-2x2-overlap": 28.8, "dipaco-2x2-paper": 31.0, "dipaco-2x2-disc": 28.9,
         "dipaco-4x4": 28.5, "stream-fp32": 29.1, "stream-4bit": 29.15}


def fake_result(c: Corpus, job, fp: str) -> dict:
    """What a job's child would write, with made-up numbers."""
    name = job.name
    data = {"fingerprint": fp, "job": name, "corpus": c.name, "record": {}, "rounds": [], "run_info": {}, "evals": {}}
    if name.startswith("start-lr"):
        data["rounds"] = [{"round": 1, "val_loss_mean": 4.0 if name == "start-lr0.005" else 4.2}]
    elif name == "start":
        data["rounds"] = [{"round": r, "val_loss_mean": 4.0 - 0.1 * r} for r in (1, 2)]
        data["run_info"] = {"parameters": {"total": 1000, "per_path": 1000}, "workers": 1, "grid": "1"}
        data["evals"]["heldout"] = {"methods": {"pretrained start": {"perplexity": 40.0, "tokens": 500}}}
    elif name.startswith("pilot-outer"):
        data["evals"]["val"] = {"methods": {name: {"perplexity": 30.0 if "lr1-m0" in name else 31.0}}}
    else:
        sp = next(x for x in c.specs() if x.name == name)
        data["record"] = {"label": sp.label, "outer_step": [1.0, 0.0]}
        paths = {"1": 1, "4": 4, "2x2": 4, "4x4": 16}
        grid = "1" if sp.name.startswith(("dense", "diloco")) else sp.shards.split("-")[0].replace("iid", "4")
        data["run_info"] = {"parameters": {"total": 1000 * paths.get(grid, 4) // (2 if "2x2" in grid else 1) + 100 * ("private" in name),
                                           "per_path": 1000}, "workers": sp.workers, "grid": grid}
        data["rounds"] = [{"round": r, "seconds": 1.0, "bytes_sent": 10 if sp.workers > 1 else 0} for r in range(1, sp.rounds + 1)]
        for r in c.eval_rounds(sp):
            ppl = FINAL.get(name, 30.0) + (sp.rounds - r) * (0.5 if name != "dipaco-2x2" else 0.1)  # 2x2's lead shrinks
            data["evals"][f"heldout_r{r}"] = {"methods": {sp.label: {"perplexity": ppl, "tokens": 500,
                                                                     "per_label": {"a": ppl - 1, "b": ppl + 1}}}}
        if sp.routing:
            methods = data["evals"][f"heldout_r{sp.rounds}"]["methods"]
            methods[sp.label]["once_policy"] = {"name": "prefix-loss + router prior"}
            methods[f"{sp.label} every-{S.route_every}"] = {
                "perplexity": FINAL[name] - 0.3, "forward_passes": 4,
                "policy": {"name": "lagged-loss n=1 m=0.1", "reason": "lowest", "one_path": {"name": "stay", "forward_passes": 1}}}
            methods[f"{sp.label} every-{S.route_every} one-path"] = {"perplexity": FINAL[name]}
            methods[f"{sp.label} oracle"] = {"perplexity": FINAL[name] - 2}
            val = 25.0 if name == "dipaco-2x2-private" else 26.0
            data["evals"]["val"] = {"methods": {sp.label: {"perplexity": val}, f"{sp.label} every-{S.route_every}": {"perplexity": val - 0.1}}}
    return data


def simulate(c: Corpus, results: Path, out: Path, skip: tuple[str, ...] = ()) -> list:
    """Plan, 'run' (write the fake results of) every job whose fingerprint is known, and plan again until done."""
    for _ in range(12):
        jobs = c.jobs()
        todo = [j for j in plan(jobs, results, out) if j.durable and j.name not in skip]
        ready = [j for j in todo if j.fp and store.load(results, c.name, j.name, j.fp) is None]  # (not re-trainings)
        if not ready:
            return jobs
        for j in ready:
            store.save(results, c.name, j.name, fake_result(c, j, j.fp))
    raise AssertionError("planning did not converge")


@pytest.fixture
def corpus(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "x"}\n')
    return Corpus("default", tmp_path / "out", S, data, tmp_path / "jobs")


def test_plan_runs_what_is_missing_and_skips_what_is_durable(corpus, tmp_path):
    out, results = tmp_path / "out", tmp_path / "jobs"
    first = plan(corpus.jobs(), results, out)  # nothing durable: every job runs (the re-sharding for its row)
    assert {j.name for j in first} == {j.name for j in corpus.jobs()}
    assert {j.name for j in first if j.fp} == {f"start-lr{lr:g}" for lr in S.pretrain_lrs}  # the rest wait for their inputs
    jobs = simulate(corpus, results, out)
    # all durable; the run directories are gone (a new session): nothing to run, not even the start
    assert plan(jobs, results, out) == []
    # one result lost: that row runs again, and the start with it (its weights are needed and gone)
    (results / "default" / "dipaco-2x2-private.json").unlink()
    assert {j.name for j in plan(corpus.jobs(), results, out)} == {"dipaco-2x2-private", "start"}
    # a stale fingerprint counts as missing
    simulate(corpus, results, out)
    f = results / "default" / "flat-4.json"
    f.write_text(json.dumps(json.loads(f.read_text()) | {"fingerprint": "0" * 16}))
    assert {j.name for j in plan(corpus.jobs(), results, out)} == {"flat-4", "start"}
    # the re-sharded row needs the re-sharding, which needs DiPaCo 2x2's weights
    simulate(corpus, results, out)
    (results / "default" / "dipaco-2x2-disc.json").unlink()
    assert {j.name for j in plan(corpus.jobs(), results, out)} == {"dipaco-2x2-disc", "reshard", "dipaco-2x2", "start"}


def test_fingerprints_follow_the_settings_chosen_upstream(corpus, tmp_path):
    out, results = tmp_path / "out", tmp_path / "jobs"
    jobs = simulate(corpus, results, out)
    before = {j.name: j.fp for j in jobs}
    f = results / "default" / "start-lr0.002.json"  # the pilot now prefers the other lr: everything downstream is stale
    store.save(results, "default", "start-lr0.002", json.loads(f.read_text()) | {"rounds": [{"round": 1, "val_loss_mean": 3.0}]})
    todo = plan(jobs, results, out)
    assert {j.name for j in todo} == {j.name for j in jobs} - {f"start-lr{lr:g}" for lr in S.pretrain_lrs}
    assert store.fingerprint({"a": 1}, out, {}) == store.fingerprint({"a": 1}, out, {}) != store.fingerprint({"a": 2}, out, {})
    assert before["dipaco-2x2"] != before["flat-4"]


def test_report_from_durable_results(corpus, tmp_path):
    out, results = tmp_path / "out", tmp_path / "jobs"
    jobs = simulate(corpus, results, out)
    corpus.valid = valid(jobs, results)["default"]
    res = collect(corpus)
    runs = res["runs"]
    assert all(r["status"] == "done" for r in runs.values())
    assert res["headline"]["run"] == "dipaco-2x2-private"  # lowest validation perplexity, not lowest held-out
    assert set(res["headline"]["chosen_on_validation"]) == set(HEADLINE)
    assert runs["dipaco-2x2-private"]["parameters_total"] > runs["dipaco-2x2"]["parameters_total"]
    rt = res["routing"]["dipaco-2x2"]
    assert rt["forward_passes"] == 4 and rt["one_path_rule"] == "stay" and rt["one_path"] == FINAL["dipaco-2x2"]
    assert rt["once_rule"] == "prefix-loss + router prior"
    assert set(res["lead"]) == set(CURVES) and res["lead"]["flat-4"]["rounds"] == [0, 1, 2]
    assert res["lead"]["flat-4"]["lead_pct"][-1] == pytest.approx(100 * (1 - 27.0 / 30.0))
    e = {x["id"]: x for x in res["expectations"]}
    assert e["dipaco_below_dense_5pct"]["held"] is True and "DiPaCo 2x2, private" in e["dipaco_below_dense_5pct"]["measured"]
    assert e["every64_below_once"]["held"] is True and "4x the forward passes" in e["every64_below_once"]["measured"]
    assert e["dipaco_4x4_below_2x2"]["held"] is True and e["bytes_400x"]["held"] is None  # no workers: no bytes ratio
    full = results_json([corpus], {"default": res}, "tiny", S)
    text = page(full, S, {"default": {"lead": "results/lead_default.png"}}, "python bench/reproduce.py --scale tiny")
    assert "| DiPaCo 2x2, private embedding and blocks 0, 3 (headline) |" in text and "lead_default.png" in text
    assert "`grid.private_blocks=[0, 3]`" in text and "4x |" in text and MISSING not in text.split("## Corpus")[1]
    assert "`dipaco_below_dense_5pct` holds" in text
    (tmp_path / "page.md").write_text(text)
    lines = readme_lines(full)
    assert "6.0% below dense" in lines and "docs/RESULTS.md" in lines


def test_a_failed_expectation_says_by_how_much_and_points_at_the_lead(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(FINAL, "dipaco-2x2-private", 29.0)  # 3.3% below dense of 30
    out, results = tmp_path / "out", tmp_path / "jobs"
    corpus.valid = valid(simulate(corpus, results, out), results)["default"]
    res = collect(corpus)
    text = page(results_json([corpus], {"default": res}, "tiny", S), S, {}, "cmd")
    assert "3.3% below dense, 1.7 points short of the 5% expected" in text and "lead_default.png" in text


def test_report_only_marks_missing_rows(corpus, tmp_path):
    out, results = tmp_path / "out", tmp_path / "jobs"
    simulate(corpus, results, out, skip=("dipaco-2x2-overlap",))
    jobs = corpus.jobs()
    plan(jobs, results, out)
    corpus.valid = valid(jobs, results)["default"]
    res = collect(corpus)
    assert res["runs"]["dipaco-2x2-overlap"]["status"] == MISSING and res["headline"] is None  # not chosen on a partial set
    e = {x["id"]: x for x in res["expectations"]}
    assert e["dipaco_below_dense_5pct"]["held"] is None and e["dipaco_4x4_below_2x2"]["held"] is True
    text = page(results_json([corpus], {"default": res}, "tiny", S), S, {}, "cmd")
    assert f"| DiPaCo 2x2, top-2 overlap in training | {MISSING} |" in text


def test_readme_lines_replace_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# dipaco\n\nintro\n\n{README_BEGIN}\nold figures\n{README_END}\n\n## Next\n")
    assert write_readme(readme, "new lines")
    assert readme.read_text() == f"# dipaco\n\nintro\n\n{README_BEGIN}\nnew lines\n{README_END}\n\n## Next\n"
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not write_readme(plain, "x") and plain.read_text() == "no markers\n"
