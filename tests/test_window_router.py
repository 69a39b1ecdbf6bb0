"""The window router of every-W routing: fitted on the router documents with loss labels, saved with the
run, used by `dipaco eval --route-every W` and `dipaco generate`."""

import json

import numpy as np
import pytest

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.eval.api import load
from dipaco.eval.generate import generate
from dipaco.eval.perplexity import evaluate
from dipaco.eval.window_router import window_examples
from dipaco.routing import Router
from dipaco.sharding.writer import shard

from conftest import shard_config
from eval_helpers import PRIVATE, trained_run

W = 16


@pytest.fixture(scope="module")
def fitted(corpus_file, shards_2x2, tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    cfg = shard_config("2x2", "data.router_fraction=0.2", "data.heldout_fraction=0.05")
    shard([str(corpus_file)], cfg, root / "shards", tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    run = trained_run(tmp_path_factory, root / "shards", *PRIVATE)
    assert main(["fit-window-router", "--run", str(run), "--shards", str(root / "shards"), "--window", str(W),
                 "--quiet", "--max-tokens", "256"]) == 0
    return root / "shards", run


def test_window_examples_are_the_chunks_after_the_first():
    ids = [list(range(20)), list(range(100))]
    ex = window_examples(ids, context=32, w=16)
    assert ex == [(1, lo, min(lo + 16, 100)) for lo in range(48, 100, 16)]


@pytest.mark.slow
def test_fit_window_router_cli(fitted, capsys):
    shards, run = fitted
    folder = run / "window_routers" / f"w{W}"
    router = Router.load(folder)
    info = json.loads((folder / "router.json").read_text())
    assert router.kind == "window" and router.input.tokens == W and router.anchor_coef.shape == (4, 4) and router.paths == Router.load(shards / "router").paths
    assert info["window"] == W and info["examples"] > info["test_examples"] > 0
    # the labels are the lowest-loss paths: the oracle loss bounds every rule, and routing rules are accuracies
    assert info["loss_oracle"] <= min(info["loss_window_router"], info["loss_document_path"], info["loss_window_alone"],
                                      info["loss_shard_router_previous_tokens"])
    assert 0 <= info["accuracy"] <= 1 and 0 <= info["accuracy_document_path"] <= 1
    # refitting needs --overwrite; a dense run or a bad window is refused
    with pytest.raises(DipacoError, match="already exists"):
        from dipaco.eval.window_router import fit_window_router

        fit_window_router(run, shards, W, progress=False)
    assert main(["fit-window-router", "--run", str(run), "--shards", str(shards), "--window", "0", "--quiet"]) == 2
    assert "window of at least 1 token" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_and_generate_use_the_window_router(fitted):
    shards, run = fitted
    rep = evaluate({"d": run}, shards, progress=False, route_every=[W, 24])
    m = rep["methods"]
    assert m[f"d every-{W}"]["window_router"] and m[f"d every-{W}"]["policy"]["source"].endswith("policy.json")
    assert m["d every-24"]["policy"]["source"] == "chosen now on the router documents"  # no fitted rule for 24
    assert m[f"d every-{W}"]["tokens"] == m["d"]["tokens"] == m["d every-24"]["tokens"]
    # the run had no once rule: fit-window-router chose one and saved it, so generate routes by what the policy builds on
    once = json.loads((run / "routing" / "once.json").read_text())
    assert m[f"d every-{W}"]["policy"]["once_rule"] == once["name"] == m["d"]["once_policy"]["name"]
    rr = load(run, shards)
    assert rr.window_sizes() == [W]
    prompt = json.loads((shards / "heldout" / "docs.jsonl").read_text().splitlines()[0])["text"][:200]
    g = generate(rr, prompt, max_new_tokens=3 * W, seed=0)  # the run has one fitted W: its rule is used
    policy = json.loads((run / "window_routers" / f"w{W}" / "policy.json").read_text())
    assert (policy.get("one_path") or policy)["name"] in g.router and sum(n for _, n in g.segments) == g.new_tokens
    one = generate(rr, prompt, max_new_tokens=3 * W, seed=0, route_every=0)
    assert len(g.segments) == -(-g.new_tokens // W) and g.segments[0][0] == one.segments[0][0]
    assert abs(sum(w for _, w in g.paths) - 1.0) < 1e-9
    assert len(one.segments) == 1 and once["name"] in one.router
    if len({p for p, _ in g.segments}) == 1:  # the same path throughout: the same greedy text
        assert one.text == g.text
    # every rule runs in generation too: the window router, and the lagged loss (which loads every path)
    folder = run / "window_routers" / f"w{W}"
    saved = (folder / "policy.json").read_text()
    prefix_loss = once["name"] != "shard-router"  # then every path reads the prompt to route it
    try:
        for kind, loads_all in (("window-router", prefix_loss), ("lagged-loss", True)):
            (folder / "policy.json").write_text(json.dumps({"chosen": {"kind": kind, "margin": 0.0, "lookback": 1},
                                                            "reason": "a test", "split": "router_docs",
                                                            "once_rule": once["name"]}))
            g = generate(rr, prompt, max_new_tokens=3 * W, seed=0)
            assert kind in g.router and len(g.segments) == -(-g.new_tokens // W)
            assert (g.bytes_loaded == g.bytes_total) == loads_all
        # a rule chosen while routing once used another rule is not followed ("stay" meant another path then)
        (folder / "policy.json").write_text(json.dumps({"chosen": {"kind": "shard-router", "lookback": 32},
                                                        "reason": "old", "split": "router_docs",
                                                        "once_rule": "another-once-rule"}))
        g = generate(rr, prompt, max_new_tokens=3 * W, seed=0)
        assert "stay" in g.router and "another-once-rule" in g.router and {p for p, _ in g.segments} == {one.segments[0][0]}
        assert "routing once used another-once-rule" in evaluate({"d": run}, shards, progress=False, route_every=[W])[
            "methods"][f"d every-{W}"]["policy"]["source"]
    finally:
        (folder / "policy.json").write_text(saved)


@pytest.mark.slow
def test_too_few_router_windows_warn_and_keep_routing_once(shards_2x2, tmp_path_factory, capsys, monkeypatch):
    """The session shards keep 0.5% router documents: far too few windows. No window router is fitted; one line
    warns; the every-W rule is chosen on the router documents only, and with that few chunks it is routing once."""
    import shutil

    import dipaco.eval.documents as documents

    run = tmp_path_factory.mktemp("few") / "run"
    shutil.copytree(trained_run(tmp_path_factory, shards_2x2, *PRIVATE), run)
    monkeypatch.setattr(documents, "heldout_tokens", lambda *a, **k: pytest.fail("the choice read held-out documents"))
    monkeypatch.setattr(documents, "validation_tokens", lambda *a, **k: pytest.fail("the choice read validation documents"))
    assert main(["fit-window-router", "--run", str(run), "--shards", str(shards_2x2), "--window", str(W), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "too few to fit a window router" in err
    folder = run / "window_routers" / f"w{W}"
    assert not (folder / "router.json").exists()
    policy = json.loads((folder / "policy.json").read_text())
    assert policy["split"] == "router_docs" and policy["name"] == policy["one_path"]["name"] == "stay"
    assert policy["chunks"] < 200 and all(v >= policy["window_oracle"] for v in policy["scores"].values())
    monkeypatch.undo()
    rep = evaluate({"d": run}, shards_2x2, progress=False, route_every=[W])
    assert rep["methods"][f"d every-{W}"]["policy"]["name"] == policy["name"]
    assert rep["methods"][f"d every-{W}"]["window_router"] is None


def test_window_router_rules_are_scored_out_of_fold():
    """The every-W rule is chosen on the router documents the window router is fitted on, so its rules are scored
    with logits from routers that never saw the document: each fold's logits are those of a fit on the other folds,
    and on labels that are pure noise the in-sample router looks far better than chance while out of fold it is not."""
    from types import SimpleNamespace

    from dipaco.eval.window_router import out_of_fold_logits
    from dipaco.routing.discriminative import fit_window

    rng = np.random.default_rng(0)
    n, paths = 400, 4
    x = rng.normal(size=(n, 64))
    labels = rng.integers(0, paths, n)  # nothing in x predicts them
    document = rng.integers(0, paths, n)
    fold = rng.permutation(n) % 5
    router = SimpleNamespace(features=None, shape=(2, 2))
    logits = out_of_fold_logits(router, x, document, labels, fold, None, seed=0)
    inside = fold == 3
    shares = np.bincount(labels[~inside], minlength=paths) + 1.0
    alone = fit_window(None, x[~inside], document[~inside], labels[~inside], (2, 2), shares, None, 0)
    assert np.allclose(logits[inside], alone.window_logits(x[inside], document[inside]), atol=1e-5)
    in_sample = fit_window(None, x, document, labels, (2, 2), np.bincount(labels, minlength=paths) + 1.0, None, 0)
    accuracy_in = (in_sample.window_logits(x, document).argmax(axis=1) == labels).mean()
    accuracy_out = (logits.argmax(axis=1) == labels).mean()
    assert accuracy_in > 0.4 and accuracy_out < 0.33, (accuracy_in, accuracy_out)  # chance: 0.25
    # a fold that holds every example has nothing to fit on: its windows keep the document's path
    kept = out_of_fold_logits(router, x[:10], document[:10], labels[:10], np.zeros(10, dtype=int), None, seed=0)
    assert (kept.argmax(axis=1) == document[:10]).all()
