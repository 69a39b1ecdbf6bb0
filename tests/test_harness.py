"""lm-evaluation-harness on tiny trained runs, offline: the dipaco model (dipaco.eval.harness) gives dipaco eval's
perplexity on the held-out documents, what the harness's own hf model gives on an exported path, one path per
multiple-choice question (chosen by the context), and `dipaco lm-eval` writes every request's path."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from eval_helpers import PRIVATE, trained_run

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval", reason="the harness tests need the eval extra: pip install -e '.[eval]'")

W = 64
FORCED_ONCE = {"chosen": {"kind": "prefix-loss", "prior": False}, "name": "prefix-loss", "reason": "forced by the test"}
FORCED_EVERY = {"chosen": {"kind": "lagged-loss", "margin": 0.0, "lookback": 1}, "name": "lagged-loss n=1 m=0",
                "reason": "forced by the test", "once_rule": "prefix-loss", "split": "router_docs"}


@pytest.fixture(scope="module")
def setup(shards_2x2, tmp_path_factory):
    """A 2x2 run (every component private) routed by prefix-loss once and lagged-loss every 64 tokens (forced: the
    session shards keep too few router documents for either to be chosen), a dense run, and the local tasks."""
    from dipaco.eval.harness_tasks import generation_task, heldout_tasks
    from dipaco.storage.shards import ShardSet

    root = tmp_path_factory.mktemp("harness")
    # no held-out document is cut (dipaco eval scores at most max_tokens_per_doc tokens, the harness the whole text)
    base = trained_run(tmp_path_factory, shards_2x2, *PRIVATE[:-1], "eval.max_tokens_per_doc=100000")
    run = root / "run"
    shutil.copytree(base, run)
    (run / "routing").mkdir(exist_ok=True)
    (run / "routing" / "once.json").write_text(json.dumps(FORCED_ONCE))
    for w in (W, 4):  # every 64 tokens for rolling, every 4 for generation
        (run / "window_routers" / f"w{w}").mkdir(parents=True)
        (run / "window_routers" / f"w{w}" / "policy.json").write_text(json.dumps(FORCED_EVERY))
    dense = trained_run(tmp_path_factory, shards_2x2, 'grid.shape="1"')
    tasks = root / "tasks"
    heldout_tasks(shards_2x2, tasks)
    shards = ShardSet(shards_2x2)
    # generation that runs its whole length (no stop string comes up), so whole greedy sequences are compared
    generation_task(tasks, shards.tokenizer(), shards.heldout(), name="heldout_gen_long", until=("@@@",))
    return {"run": run, "dense": dense, "tasks": tasks, "shards": shards_2x2, "root": root}


def _evaluate(model, setup, tasks, **kw):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(setup["tasks"]), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, log_samples=True, **kw)


def _responses(results, task) -> list:
    return [resps[0] for s in results["samples"][task] for resps in s["resps"]]


def test_rolling_gives_dipaco_eval_perplexity_once_and_every_w(setup):
    from dipaco.eval.harness import DipacoLM, add_paths
    from dipaco.eval.perplexity import evaluate

    report = evaluate({"h": setup["run"]}, setup["shards"], progress=False, route_every=[W])["methods"]
    assert "prefix-loss" in report["h"]["routing"] and "lagged-loss" in report[f"h every-{W}"]["routing"]
    # the rules matter on these documents: prefix-loss routes otherwise than the shard router, lagged-loss switches
    documents = {name: {p: v["documents"] for p, v in report[name]["per_path"].items()} for name in report}
    assert documents["h"] != documents["h shard-router"]
    for every, row in ((0, report["h"]), (W, report[f"h every-{W}"])):
        lm = DipacoLM(run=str(setup["run"]), route_every=every, progress=False)
        try:
            results = add_paths(_evaluate(lm, setup, ["heldout_ppl"]), lm)
        finally:
            lm.close()
        out = _responses(results, "heldout_ppl")
        nll, tokens = -sum(out), sum(r.tokens for r in out)
        assert tokens == row["tokens"] and len(out) == row["documents"]
        assert math.exp(nll / tokens) == pytest.approx(row["perplexity"], rel=1e-4)
        assert results["dipaco"]["token_perplexity"]["heldout_ppl"] == {"perplexity": math.exp(nll / tokens),
                                                                        "tokens": tokens}
        if every:
            assert any(len(set(r.route)) > 1 for r in out)  # some documents were re-routed
            assert math.exp(nll / tokens) != pytest.approx(report["h"]["perplexity"], rel=1e-4)
        else:
            assert Counter(r.route for r in out) == {p: n for p, n in documents["h"].items() if n}


@pytest.mark.parametrize("which,path", [("dense", None), ("run", "0-1")])
def test_a_dense_run_and_a_pinned_path_give_what_hf_gives_on_the_export(setup, which, path):
    from dipaco.eval.api import load
    from dipaco.eval.harness import DipacoLM

    export = setup["root"] / f"export-{which}"
    load(setup[which]).export(path or "0", export)
    tasks = ["heldout_ppl", "heldout_choice", "heldout_gen", "heldout_gen_long"]
    if path is None:
        lm = DipacoLM(run=str(setup[which]), rolling="all", progress=False)
        try:
            ours = _evaluate(lm, setup, tasks, limit=8)
        finally:
            lm.close()
    else:  # by its registered name and model_args, as the harness builds any model
        ours = _evaluate("dipaco", setup, tasks, limit=8, model_args=f"run={setup[which]},path={path},rolling=all")
    hf = _evaluate("hf", setup, tasks, limit=8, model_args=f"pretrained={export},dtype=float32", device="cpu",
                   batch_size=4)
    for a, b in zip(_responses(ours, "heldout_ppl"), _responses(hf, "heldout_ppl")):
        assert a == pytest.approx(b, rel=1e-4)
    choices = list(zip(_responses(ours, "heldout_choice"), _responses(hf, "heldout_choice")))
    assert len(choices) == 32 and all(a[0] == pytest.approx(b[0], rel=1e-4) and a[1] == b[1] for a, b in choices)
    generated = list(zip(_responses(ours, "heldout_gen_long"), _responses(hf, "heldout_gen_long")))
    assert all(a == b for a, b in generated) and any(len(a) > 4 for a, _ in generated)
    assert _responses(ours, "heldout_gen") == _responses(hf, "heldout_gen")  # cut at the first newline
    assert {a.route for a, _ in choices} == {path or "0"}


def test_choices_of_a_question_share_the_path_of_their_context(setup):
    from dipaco.eval.generate import loaded_scorer, route_ids
    from dipaco.eval.harness import DipacoLM, add_paths

    lm = DipacoLM(run=str(setup["run"]), progress=False)
    try:
        results = add_paths(_evaluate(lm, setup, ["heldout_choice", "heldout_gen", "heldout_gen_long"]), lm)
        short = lm.tok_encode("def")  # shorter than the routing prefix: routed by what it has
        assert lm.routes([short], "test") == [route_ids(lm.rr, short, score=lm.engine.score)[0]]
    finally:
        lm.close()
    firsts, score = [], loaded_scorer(lm.rr)
    for sample in results["samples"]["heldout_choice"]:
        paths = sample["dipaco_paths"]
        assert len(paths) == 4 and len(set(paths)) == 1
        context = lm.tok_encode(sample["arguments"][0][0])
        firsts.append(paths[0])
        assert paths[0] == route_ids(lm.rr, context, score=score)[0]  # what dipaco generate answers
    assert len(set(firsts)) > 1
    counts = results["dipaco"]["requests_per_path"]
    assert sum(counts["heldout_choice"].values()) == 4 * len(firsts) and "prefix-loss" in results["dipaco"]["routing"]
    assert sum(counts["heldout_gen"].values()) == len(results["samples"]["heldout_gen"])
    # a routed generation is dipaco generate's: the same path, the same greedy text
    for sample in results["samples"]["heldout_gen_long"][:3]:
        g = lm.rr.generate(sample["arguments"][0][0], max_new_tokens=16, route_every=0)
        assert (sample["resps"][0][0], sample["dipaco_paths"][0]) == (g.text, g.paths[0][0])

    # the results page's downstream step (bench/reproduce.py --downstream) scores the same questions the same way
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from reproduce_corpus import DOWNSTREAM_TASK
    from reproduce_jobs import _downstream

    step = {"op": "downstream", "key": "heldout_choice", "shards": str(setup["shards"]), **DOWNSTREAM_TASK}
    row = _downstream(setup["run"], step)
    assert row["questions"] == len(firsts) and sum(row["requests_per_path"].values()) == 4 * len(firsts)
    for metric in ("acc", "acc_stderr", "acc_norm"):
        assert row[metric] == pytest.approx(results["results"]["heldout_choice"][f"{metric},none"])


def test_generation_re_routed_every_w_tokens_is_dipaco_generates(setup):
    from dipaco.eval.api import load
    from dipaco.eval.harness import DipacoLM

    lm = DipacoLM(run=str(setup["run"]), route_every=4, progress=False)
    try:
        samples = _evaluate(lm, setup, ["heldout_gen_long"])["samples"]["heldout_gen_long"]
    finally:
        lm.close()
    switched = [s for s in samples if len(set(s["resps"][0][0].route)) > 1]
    assert switched and all(len(s["resps"][0][0].route) == 4 for s in samples)  # 16 tokens in segments of 4
    rr = load(setup["run"])
    for sample in switched + samples[:2]:  # (dipaco generate loads every path for each prompt)
        out = sample["resps"][0][0]
        g = rr.generate(sample["arguments"][0][0], max_new_tokens=16, route_every=4)
        assert (out, out.route) == (g.text, [p for p, _ in g.segments]) and "lagged-loss" in g.router


def test_lm_eval_command_writes_paths_and_answers_from_the_cache(setup, tmp_path, monkeypatch, capsys):
    from dipaco.cli.commands import main
    from dipaco.eval import harness

    args = ["lm-eval", "--run", str(setup["run"]), "--tasks", "heldout_choice,heldout_gen", "--heldout-tasks",
            "--limit", "4", "--log_samples", "--use_cache", str(tmp_path / "cache"), "--quiet"]
    assert main(args + ["--output_path", str(tmp_path / "a")]) == 0
    assert "heldout_choice" in capsys.readouterr().out
    # every response now comes from the harness's cache, path included: no forward pass may run
    monkeypatch.setattr(harness.DipacoLM, "run_jobs", lambda *a, **k: pytest.fail("not answered from the cache"))
    assert main(args + ["--output_path", str(tmp_path / "b")]) == 0
    runs = []
    for out in ("a", "b"):
        folder = next((tmp_path / out).iterdir())
        samples = [json.loads(line) for line in next(folder.glob("samples_heldout_choice_*.jsonl")).open()]
        results = json.loads(next(folder.glob("results_*.json")).read_text())
        assert len(samples) == 4 and results["dipaco"]["requests_per_path"]["heldout_choice"]
        runs.append([s["dipaco_paths"] for s in samples])
    assert runs[0] == runs[1] and all(len(set(p)) == 1 for p in runs[0])

    capsys.readouterr()
    missing = tmp_path / "no-tasks-here"
    assert main(["lm-eval", "--run", str(setup["run"]), "--tasks", "x", "--include_path", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"dipaco lm-eval: error: --include_path {missing}: not a folder of task YAMLs\n"
    assert main(["lm-eval", "--run", str(setup["run"]), "--tasks", "heldout_choice", "--path", "9-9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "path '9-9' is not in run" in err and "choose one of 0-0, 0-1, 1-0, 1-1" in err


def test_a_missing_harness_is_one_line_naming_the_extra(monkeypatch):
    from dipaco.errors import DipacoError

    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # an import of it fails, as when not installed
    monkeypatch.delitem(sys.modules, "dipaco.eval.harness", raising=False)
    with pytest.raises(DipacoError, match=r'pip install -e "\.\[eval\]"'):
        import dipaco.eval.harness  # noqa: F401


def test_bad_model_args_are_refused_before_anything_loads():
    from dipaco.errors import DipacoError
    from dipaco.eval.harness import DipacoLM

    with pytest.raises(DipacoError, match="needs a run"):
        DipacoLM()
    with pytest.raises(DipacoError, match="pretrained unknown to the dipaco model"):
        DipacoLM(run="x", pretrained="gpt2")
    with pytest.raises(DipacoError, match="rolling='some'"):
        DipacoLM(run="x", rolling="some")
    with pytest.raises(DipacoError, match="it goes with neither path= nor rolling=all"):
        DipacoLM(run="x", route_every=64, rolling="all")
    with pytest.raises(DipacoError, match="route_every=-1 is not valid"):
        DipacoLM(run="x", route_every=-1)


def test_choice_rows_draw_wrong_answers_from_the_same_domain():
    from dipaco.eval.harness_tasks import choice_rows

    items = [{"passage": f"p{i}", "answer": f"a{i}", "domain": "code" if i < 5 else "prose"} for i in range(8)]
    rows = choice_rows(items, choices=4, seed=1)
    assert [r["passage"] for r in rows] == [f"p{i}" for i in range(5)]  # prose has 3 items: too few for 4 choices
    for i, r in enumerate(rows):
        assert r["choices"][r["label"]] == f"a{i}" and len(set(r["choices"])) == 4
        assert all(int(c[1:]) < 5 for c in r["choices"])
    assert len({r["label"] for r in rows}) > 1  # the right answer is not always in one place
