"""Routed evaluation: prefix not scored, every-W re-routing, oracle/random/early-stopping/mixture rows."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from dipaco.errors import DipacoError
from dipaco.eval.documents import heldout_tokens
from dipaco.eval.early_stopping import early_stopping_rounds
from dipaco.eval.perplexity import evaluate, mixture_weights
from dipaco.eval.scorer import Scorer, segments_of
from dipaco.eval.window_policy import Rule, chunk_cuts, decide
from dipaco.model.scoring import document_nll
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet

from eval_helpers import private_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shards_2x2):
    return private_run(tmp_path_factory, shards_2x2)


@pytest.fixture(scope="module")
def report(run_dir, shards_2x2):
    return evaluate({"dipaco": run_dir}, shards_2x2, progress=False, route_every=[16, 1_000_000], oracle=True,
                    random=True, mixture=2)


def _per_position_nll(model, ids, seq_len):
    """Brute force: NLL of every target position, each window run on its own (position 0 has none)."""
    out = np.full(len(ids), np.nan)
    with torch.no_grad():
        for start in range(0, len(ids) - 1, seq_len):
            window = torch.tensor([ids[start:start + seq_len + 1]])
            logp = torch.log_softmax(model(input_ids=window[:, :-1]).logits.float(), -1)[0]
            out[start + 1:start + window.shape[1]] = -logp.gather(1, window[0, 1:, None])[:, 0].numpy()
    return out


@pytest.mark.slow
def test_prefix_is_not_scored(run_dir, shards_2x2, report):
    run = Run(run_dir)
    _, ids = heldout_tokens(ShardSet(shards_2x2), run.config.eval.max_tokens_per_doc)
    expected = sum(max(0, len(x) - 32) for x in ids)
    assert all(m["tokens"] == expected for m in report["methods"].values())
    # the summed NLL is exactly that of positions >= 32 computed by brute force
    model, seq_len = run.path_model("0-0").model, run.config.model.max_seq_len
    docs = [x for x in ids if len(x) > 40][:3]
    got = document_nll(model, docs, context=32, seq_len=seq_len, batch_size=2)
    for x, (s, n) in zip(docs, got):
        brute = _per_position_nll(model, x, seq_len)
        assert n == len(x) - 32 and s == pytest.approx(brute[32:].sum(), rel=1e-5)


@pytest.mark.slow
def test_route_every_w_at_least_doc_length_equals_once_per_doc(report):
    once, wide = report["methods"]["dipaco"], report["methods"]["dipaco every-1000000"]
    assert wide["nll_sum"] == once["nll_sum"] and wide["perplexity"] == once["perplexity"]
    assert wide["per_path"] == once["per_path"]


class _Recorder:
    """A router that records the token runs it is given and answers by their content (so paths switch)."""

    def __init__(self, paths, tokens):
        self.paths, self.seen = paths, []
        self.input = type("Input", (), {"tokens": tokens})()

    def route_ids(self, ids):
        self.seen += [list(x) for x in ids]
        return [self.paths[sum(x[: self.input.tokens]) % len(self.paths)] for x in ids]


@pytest.mark.slow
def test_route_every_w_uses_previous_window_and_full_context(run_dir, shards_2x2, report):
    run, shards = Run(run_dir), ShardSet(shards_2x2)
    _, ids = heldout_tokens(shards, run.config.eval.max_tokens_per_doc)
    long_doc = max(ids, key=len)
    assert len(long_doc) > 100
    # a document with no scored chunk first: it must not put the long document's chunks out of step
    ids = [long_doc[:20], long_doc]
    cuts = chunk_cuts(ids, context=32, w=16)
    assert cuts[0] == [] and cuts[1] == [(lo, min(lo + 16, len(long_doc))) for lo in range(32, len(long_doc), 16)]
    shard_rec = _Recorder(run.grid.paths, 32)
    first = shard_rec.route_ids(ids)
    choice = decide(Rule("shard-router", lookback=32), cuts, first, ids, run.grid.paths, router=shard_rec)
    # chunk 0 follows the document's route; chunk k >= 1 the shard router on exactly the 32 tokens before it
    assert choice[1][0] == first[1] and shard_rec.seen[2:] == [long_doc[lo - 32:lo] for lo, _ in cuts[1][1:]]
    segs = segments_of(cuts, choice, run.latest())
    # every chunk is scored by its path with the tokens before it in the window as context
    ids, segs = [long_doc], segs[1:]
    scorer = Scorer(run, ids, batch_size=4, progress=False)
    per_doc, _ = scorer.score(segs)
    models = {p: run.path_model(p).model for p in run.grid.paths}
    seq_len = run.config.model.max_seq_len
    brute = {p: _per_position_nll(m, ids[0], seq_len) for p, m in models.items()}
    assert len({mix[0][0] for _, _, mix in segs[0]}) > 1  # the chunks really switch paths
    want = sum(brute[mix[0][0]][lo:hi].sum() for lo, hi, mix in segs[0])
    assert per_doc[0][0] == pytest.approx(want, rel=1e-5)
    # the report's every-16 row: a rule chosen on the router documents (the run has no fitted one), never worse
    # than routing once there; the window oracle is below both on the held-out documents
    w16, once = report["methods"]["dipaco every-16"], report["methods"]["dipaco"]
    assert w16["tokens"] == once["tokens"] and math.isfinite(w16["perplexity"])
    assert "chosen on the router documents" in w16["routing"] and w16["policy"]["split"] == "router_docs"
    chosen = w16["policy"]["scores"][w16["policy"]["name"]]
    assert chosen <= w16["policy"]["scores"]["stay"] and w16["policy"]["window_oracle"] <= chosen
    oracle16 = report["methods"]["dipaco window-oracle-16"]
    assert oracle16["perplexity"] <= min(w16["perplexity"], once["perplexity"], report["methods"]["dipaco oracle"]["perplexity"])
    # the cross-fitted oracles, by brute force on every held-out document: per chunk (per document), the even targets
    # take the path best on the odd ones and the other way round
    _, ids = heldout_tokens(shards, run.config.eval.max_tokens_per_doc)
    per_target = [{p: _per_position_nll(m, x, seq_len) for p, m in models.items()} for x in ids]
    for row, spans in (("dipaco window-oracle-16 cross-fitted", chunk_cuts(ids, 32, 16)),
                       ("dipaco oracle cross-fitted", [[(32, len(x))] if len(x) > 32 else [] for x in ids])):
        total = 0.0
        for d, cs in enumerate(spans):
            for lo, hi in cs:
                halves = {p: (v[lo:hi][0::2].sum(), v[lo:hi][1::2].sum()) for p, v in per_target[d].items()}
                on_odd, on_even = (min(halves, key=lambda p: halves[p][k]) for k in (1, 0))
                total += halves[on_odd][0] + halves[on_even][1]
        assert report["methods"][row]["tokens"] == once["tokens"]
        assert report["methods"][row]["nll_sum"] == pytest.approx(total, rel=1e-5), row


@pytest.mark.slow
def test_oracle_below_routed_below_random(report):
    m = report["methods"]
    oracle, routed, random = (m[k]["perplexity"] for k in ("dipaco oracle", "dipaco", "dipaco random"))
    assert oracle <= routed <= random, (oracle, routed, random)
    assert routed < 0.95 * random  # private paths on domain shards: the router clearly helps
    labels = m["dipaco"]["per_label"]  # per-domain rows, same tokens in total
    assert len(labels) >= 2 and sum(v["tokens"] for v in labels.values()) == m["dipaco"]["tokens"]
    assert m["dipaco mixture-2"]["tokens"] == m["dipaco"]["tokens"]


def test_mixture_weights_are_cbtm_softmax():
    w = mixture_weights([("a", 0.2), ("b", 0.3)], 0.1)
    assert [p for p, _ in w] == ["a", "b"]
    assert w[0][1] == pytest.approx(1 / (1 + math.exp(-1.0)))
    with pytest.raises(DipacoError):
        mixture_weights([("a", 0.2)], 0.0)


@pytest.mark.slow
def test_early_stopping_picks_lowest_val_loss_round(run_dir, shards_2x2, tmp_path):
    run_copy = tmp_path / "run"
    shutil.copytree(run_dir, run_copy)
    losses = {1: {"0-0": 3.0, "0-1": 2.0, "1-0": 5.0, "1-1": 1.0},
              2: {"0-0": 2.5, "0-1": 2.2, "1-0": 4.0, "1-1": 1.0}}
    with open(run_copy / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"kind": "inner", "round": 1, "loss": 9.0}) + "\n")
        for r, v in losses.items():
            f.write(json.dumps({"kind": "round", "round": r, "val_loss": v}) + "\n")
    assert early_stopping_rounds(Run(run_copy)) == {"0-0": 2, "0-1": 1, "1-0": 2, "1-1": 1}  # ties: earliest
    rep = evaluate({"d": run_copy}, shards_2x2, progress=False, early_stopping=True)
    row = rep["methods"]["d early-stop"]
    assert row["rounds"] == rep["early_stopping"]["d"] == {"0-0": 2, "0-1": 1, "1-0": 2, "1-1": 1}
    assert row["tokens"] == rep["methods"]["d"]["tokens"]
    assert set(rep["rounds_curve"]["d"]) == {"1", "2"}


@pytest.mark.slow
def test_bad_inputs_are_dipaco_errors(run_dir, shards_2x2):
    with pytest.raises(DipacoError, match="dense"):
        evaluate({"a": run_dir}, shards_2x2, progress=False, baseline=run_dir)
    with pytest.raises(DipacoError, match="round 99"):
        evaluate({"a": run_dir}, shards_2x2, round=99, progress=False)
    with pytest.raises(DipacoError, match="route-every"):
        evaluate({"a": run_dir}, shards_2x2, progress=False, route_every=[0])


@pytest.mark.slow
def test_eval_cli_report_with_baseline_and_plots(run_dir, shards_2x2, tmp_path_factory, tmp_path, capsys):
    from dipaco.cli.commands import main

    from eval_helpers import trained_run

    dense = trained_run(tmp_path_factory, shards_2x2, 'grid.shape="1"', "eval.max_tokens_per_doc=256",
                        rounds=1, inner_steps=4)
    out = tmp_path / "rep" / "report.json"
    assert main(["eval", "--run", f"dipaco={run_dir}", "--baseline", str(dense), "--shards", str(shards_2x2),
                 "--out", str(out), "--route-every", "32", "--early-stopping", "--mixture", "2", "--quiet"]) == 0
    rep = json.loads(out.read_text())
    names = set(rep["methods"])
    assert names == {"dipaco", "dipaco every-32", "dipaco early-stop", "dipaco mixture-2", "dipaco random",
                     "dipaco oracle", "dipaco window-oracle-32", "dense baseline",
                     "dipaco window-oracle-32 cross-fitted", "dipaco oracle cross-fitted"}
    assert len({m["tokens"] for m in rep["methods"].values()}) == 1  # every row on the same tokens
    assert rep["methods"]["dense baseline"]["per_path"].keys() == {"0"}
    for f in ("report.md", "report.png", "report_rounds.png", "report_paths.png"):
        assert (out.parent / f).stat().st_size > 0, f
    assert "| dense baseline |" in capsys.readouterr().out
    assert main(["eval", "--run", str(run_dir), "--shards", str(shards_2x2), "--out", str(tmp_path / "r.json"),
                 "--baseline", str(run_dir), "--quiet"]) == 2
