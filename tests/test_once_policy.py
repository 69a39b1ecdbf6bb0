"""Routing once: the candidate rules (shard router, prefix loss, prefix loss with the router as a prior), the choice on
the router documents, and eval and generate following the chosen rule."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from dipaco.cli.commands import main
from dipaco.eval.once_policy import (MIN_DOCUMENTS, OnceRule, decide_once, once_candidates, once_rule_of, pick_once_rule,
                                     router_log_prior)

PATHS = ["0-0", "0-1", "1-0", "1-1"]


class _Router:
    def __init__(self, kind):
        self.kind, self.paths = kind, PATHS


def test_decide_once_follows_the_rule():
    shard = ["0-0", "0-0", "1-1"]
    prefix = np.array([[5.0, 3.0, 4.0, 6.0], [2.0, 2.0, 2.0, 2.0], [1.0, 9.0, 9.0, 0.5]])
    assert decide_once(OnceRule("shard-router"), PATHS, shard) == shard
    # the lowest prefix loss; a document on which every path ties (too short to score) keeps the shard router's path
    assert decide_once(OnceRule("prefix-loss"), PATHS, shard, prefix) == ["0-1", "0-0", "1-1"]
    prior = np.log(np.array([[0.97, 0.01, 0.01, 0.01]] * 3))  # the router is sure of 0-0 for every document
    assert decide_once(OnceRule("prefix-loss", prior=True), PATHS, shard, prefix, prior) == ["0-0", "0-0", "0-0"]
    with pytest.raises(ValueError):
        decide_once(OnceRule("nonsense"), PATHS, shard, prefix)
    assert once_rule_of(OnceRule("prefix-loss", prior=True).to_dict()) == OnceRule("prefix-loss", prior=True)


def test_router_log_prior_is_the_routers_probability():
    dist = np.array([[0.2, 0.3, 1.0, 0.5]])
    disc = router_log_prior(_Router("discriminative"), dist)  # distances are negative logits
    assert np.allclose(np.exp(disc).sum(), 1) and np.allclose(disc - disc.max(), -(dist - dist.min()))
    km = router_log_prior(_Router("kmeans"), dist, temperature=0.1)  # c-BTM: softmax(-d^2 / T)
    assert np.allclose(km - km.max(), -(dist - dist.min()) / 0.1)
    assert router_log_prior(_Router("random"), dist) is None
    assert [r.name for r in once_candidates(_Router("random"))] == ["shard-router", "prefix-loss"]
    assert [r.name for r in once_candidates(_Router("kmeans"))][-1] == "prefix-loss + router prior"


def _documents(n, rng):
    """n documents whose body prefers the path their prefix prefers (so prefix-loss beats a shard router that is
    right only half the time)."""
    best = rng.integers(0, 4, n)
    body, prefix = rng.uniform(100, 110, (n, 4)), rng.uniform(20, 30, (n, 4))
    body[np.arange(n), best] -= 20
    prefix[np.arange(n), best] -= 10
    shard = [PATHS[b] if i % 2 else PATHS[(b + 1) % 4] for i, b in enumerate(best)]
    return body, prefix, shard


def test_choose_once_picks_the_lowest_and_keeps_the_shard_router_without_evidence():
    rng = np.random.default_rng(0)
    rules = once_candidates(_Router("kmeans"))
    body, prefix, shard = _documents(40, rng)
    prior = np.zeros((40, 4))
    out = pick_once_rule(rules, PATHS, shard, body, prefix, prior, tokens=40 * 100)
    assert out["name"] in ("prefix-loss", "prefix-loss + router prior") and "lowest perplexity on 40" in out["reason"]
    ppl = out["router_documents"]
    assert ppl[out["name"]] < ppl["shard-router"] and out["oracle"] <= min(ppl.values())
    assert out["picks_oracle_path"]["prefix-loss"] == 1.0 and out["picks_oracle_path"]["shard-router"] == 0.5
    # ties go to the shard router: with an uninformative prefix every rule picks the shard router's path
    tie = pick_once_rule(rules, PATHS, shard, body, np.zeros_like(prefix), prior, tokens=4000)
    assert tie["name"] == "shard-router" and "no rule beat" in tie["reason"]
    # too few router documents to trust another rule, however good it looks
    few = MIN_DOCUMENTS - 1
    small = pick_once_rule(rules, PATHS, shard[:few], body[:few], prefix[:few], prior[:few], tokens=few * 100)
    assert small["name"] == "shard-router" and f"only {few} router documents" in small["reason"]
    assert small["router_documents"]["prefix-loss"] < small["router_documents"]["shard-router"]


# ---------------------------------------------------------------------------------------------------- real runs
def _fresh_copy(tmp_path_factory, shards_2x2, name: str):
    """A copy of the shared tiny run without the routing rules earlier tests' commands saved in it."""
    from eval_helpers import private_run

    out = tmp_path_factory.mktemp(name) / "run"
    shutil.copytree(private_run(tmp_path_factory, shards_2x2), out, ignore=shutil.ignore_patterns("routing", "window_routers"))
    return out


@pytest.fixture(scope="module")
def run_copy(tmp_path_factory, shards_2x2):
    """A copy of the shared tiny run (this module writes RUN/routing/ into it)."""
    return _fresh_copy(tmp_path_factory, shards_2x2, "once")


def _prefix_nll_by_hand(run, ids, context):
    out = []
    with torch.no_grad():
        for p in run.grid.paths:
            model, row = run.path_model(p).model, []
            for x in ids:
                t = torch.tensor([x[:context]])
                logits = model(input_ids=t).logits[0, :-1].float()
                row.append(float(torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="sum")))
            out.append(row)
    return np.array(out).T


@pytest.mark.slow
def test_choose_routing_reads_only_router_documents_and_eval_and_generate_follow_it(run_copy, shards_2x2, monkeypatch,
                                                                                     capsys):
    from dipaco.eval import documents, perplexity
    from dipaco.eval.api import load
    from dipaco.eval.generate import generate
    from dipaco.storage.run import Run
    from dipaco.storage.shards import ShardSet

    def forbidden(*_):
        raise AssertionError("the once rule must be chosen without the held-out or validation documents")

    with monkeypatch.context() as m:
        m.setattr(documents, "heldout_tokens", forbidden)
        m.setattr(documents, "validation_tokens", forbidden)
        assert main(["choose-routing", "--run", str(run_copy), "--shards", str(shards_2x2), "--quiet"]) == 0
    saved = json.loads((run_copy / "routing" / "once.json").read_text())
    assert saved["split"] == "router_docs" and "routing once uses" in capsys.readouterr().out
    # a second choice is refused without --overwrite (one line, exit 2), and allowed with it
    assert main(["choose-routing", "--run", str(run_copy), "--shards", str(shards_2x2), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["choose-routing", "--run", str(run_copy), "--shards", str(shards_2x2), "--quiet", "--overwrite"]) == 0

    # force the prefix-loss rule: eval routes each held-out document to the path with the lowest loss on its first
    # 32 tokens (computed by hand here), and keeps the shard router's row beside it
    forced = saved | {"chosen": OnceRule("prefix-loss").to_dict(), "name": "prefix-loss", "reason": "forced by the test"}
    (run_copy / "routing" / "once.json").write_text(json.dumps(forced))
    run, shards = Run(run_copy), ShardSet(shards_2x2)
    _, ids = documents.heldout_tokens(shards, run.config.eval.max_tokens_per_doc)
    # an every-W rule chosen while routing once was another rule is chosen again (its "stay" was another path)
    stale = run_copy / "window_routers" / "w1000000"
    stale.mkdir(parents=True)
    (stale / "policy.json").write_text(json.dumps({"chosen": {"kind": "stay"}, "name": "stay", "reason": "old",
                                                   "once_rule": "shard-router", "split": "router_docs"}))
    rep = perplexity.evaluate({"dipaco": run_copy}, shards_2x2, progress=False, oracle=True, route_every=[10**6])
    assert "when routing once used shard-router" in rep["methods"]["dipaco every-1000000"]["policy"]["source"]
    routed, shard_row = rep["methods"]["dipaco"], rep["methods"]["dipaco shard-router"]
    assert "prefix-loss" in routed["routing"] and routed["once_policy"]["reason"] == "forced by the test"
    scored = [x for x in ids if len(x) > 32]
    want = [run.grid.paths[int(j)] for j in _prefix_nll_by_hand(run, scored, 32).argmin(axis=1)]
    docs = {p: v["documents"] for p, v in routed["per_path"].items() if v["documents"]}
    assert docs == {p: want.count(p) for p in set(want)}
    assert shard_row["tokens"] == routed["tokens"] and math.isfinite(shard_row["perplexity"])
    assert rep["methods"]["dipaco every-1000000"]["nll_sum"] == routed["nll_sum"]  # "stay" is the once rule's path
    assert rep["methods"]["dipaco oracle"]["perplexity"] <= routed["perplexity"]

    # generate routes a prompt the same way: every path reads the prompt's first tokens, one path answers
    rr = load(run_copy)
    prompt = "def main():\n    return the value of the first argument plus one"
    g = generate(rr, prompt, max_new_tokens=4, route_every=0)
    by_hand = _prefix_nll_by_hand(run, [rr.encode(prompt)], 32)[0]
    assert g.paths == [(run.grid.paths[int(by_hand.argmin())], 1.0)] and "prefix-loss" in g.router
    assert g.bytes_loaded == g.bytes_total  # every path was read to choose


@pytest.mark.slow
def test_without_a_saved_rule_eval_and_generate_route_every_document_alike(tmp_path_factory, shards_2x2, monkeypatch,
                                                                            capsys):
    """The once rule is decided once: whichever command needs it first (eval here, generate on a second copy) chooses
    it on the router documents, saves RUN/routing/once.json, and every later command routes by it. The session shards
    keep two router documents, where the shard router always wins; the choice is forced to prefix-loss so that a
    command routing by another rule than eval's would send documents elsewhere."""
    from collections import Counter

    from dipaco.eval import documents, once_policy, perplexity
    from dipaco.eval.api import load
    from dipaco.storage.run import Run
    from dipaco.storage.shards import ShardSet

    real = once_policy.pick_once_rule
    monkeypatch.setattr(once_policy, "pick_once_rule", lambda *a: real(*a) | {
        "chosen": OnceRule("prefix-loss").to_dict(), "name": "prefix-loss", "reason": "forced by the test"})
    first_eval, first_generate = (_fresh_copy(tmp_path_factory, shards_2x2, n) for n in ("eval-first", "generate-first"))

    rep = perplexity.evaluate({"d": first_eval}, shards_2x2, progress=False, oracle=False, random=False)
    routed = rep["methods"]["d"]
    saved = json.loads((first_eval / "routing" / "once.json").read_text())
    assert saved["name"] == routed["once_policy"]["name"] == "prefix-loss" and routed["once_policy"]["chosen_now"]
    run, shards = Run(first_eval), ShardSet(shards_2x2)
    docs = [d["text"] for d in shards.heldout()]
    _, ids = documents.heldout_tokens(shards, run.config.eval.max_tokens_per_doc)
    scored = [text for text, x in zip(docs, ids) if len(x) > run.config.eval.context_tokens]
    rr = load(first_eval, progress=False)
    answers = [rr.path_for(text) for text in scored]  # what generate routes each document's text to
    assert rr.once_chosen_now is None  # generate read the saved rule
    assert Counter(answers) == Counter({p: v["documents"] for p, v in routed["per_path"].items() if v["documents"]})
    assert answers != rr.route(scored)  # the rule matters here: the shard router alone answers otherwise

    # the other order: generate first chooses the same rule, saves it, and eval reads it
    assert main(["generate", "--run", str(first_generate), "--prompt", scored[0], "--max-new-tokens", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "had no once rule: routing once uses prefix-loss" in err and "saved to" in err
    assert f"# path {answers[0]}:" in err and "once, prefix-loss" in err
    assert json.loads((first_generate / "routing" / "once.json").read_text()) == saved
    assert once_policy.find_once_policy(Run(first_generate), shards)["source"] == str(first_generate / "routing" / "once.json")


@pytest.mark.slow
def test_a_damaged_rule_is_one_line_and_its_command_rewrites_it(tmp_path_factory, shards_2x2, capsys):
    run = _fresh_copy(tmp_path_factory, shards_2x2, "damaged")
    s, r = str(shards_2x2), str(run)
    once, policy = run / "routing" / "once.json", run / "window_routers" / "w64" / "policy.json"
    commands = {"eval": ["eval", "--run", r, "--shards", s, "--out", str(run.parent / "rep.json"), "--no-oracle",
                         "--no-random", "--route-every", "64", "--quiet"],
                "generate": ["generate", "--run", r, "--prompt", "def main():", "--max-new-tokens", "1", "--quiet"],
                "fit-window-router": ["fit-window-router", "--run", r, "--shards", s, "--window", "64", "--quiet"]}

    def one_line(command: str) -> str:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"dipaco {command}: error: "), err
        return err

    once.parent.mkdir()
    once.write_text('{"chosen": {"kind": "nearest"}, "name": "x", "reason": "y"}')
    for command, argv in commands.items():
        assert main(argv) == 2
        err = one_line(command)
        assert f"{once} is damaged (unknown rule 'nearest'" in err and "dipaco choose-routing --run" in err
    assert main(["choose-routing", "--run", r, "--shards", s, "--quiet", "--overwrite"]) == 0
    assert json.loads(once.read_text())["name"] == "shard-router"
    capsys.readouterr()

    assert main(commands["fit-window-router"]) == 0  # too few router windows: a policy.json alone
    assert "too few to fit a window router" in capsys.readouterr().err
    policy.write_text("{damaged")
    for command in ("eval", "generate"):
        assert main(commands[command]) == 2
        err = one_line(command)
        assert f"{policy} is damaged (not valid JSON" in err and "dipaco fit-window-router --run" in err
    assert main([*commands["fit-window-router"], "--overwrite"]) == 0
    assert json.loads(policy.read_text())["split"] == "router_docs"
    assert main(commands["generate"]) == 0


def test_once_forward_passes_on_the_routing_context():
    from dipaco.eval.once_policy import OnceRule

    assert OnceRule("shard-router").forward_passes(4) == 0  # features only
    assert OnceRule("prefix-loss").forward_passes(4) == 4 == OnceRule("prefix-loss", prior=True).forward_passes(4)
