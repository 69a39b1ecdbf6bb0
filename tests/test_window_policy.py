"""Every-W rules and their choice on validation chunks (dipaco.eval.window_policy), on synthetic losses (fast tier)."""

from __future__ import annotations

import numpy as np
import pytest

from dipaco.eval.perplexity import cross_fitted_oracle_nll
from dipaco.eval.window_policy import MIN_CHUNKS, Rule, candidates, chunk_cuts, decide, pick_window_rule, total_nll

PATHS = ["0-0", "0-1", "1-0", "1-1"]


def synthetic(docs: int, chunks: int, seed: int = 0, switch_every: int = 3):
    """Documents whose best path changes every few chunks (so re-routing pays), with noisy losses."""
    rng = np.random.default_rng(seed)
    cuts = [[(32 + 8 * k, 40 + 8 * k) for k in range(chunks)] for _ in range(docs)]
    nll = []
    for d in range(docs):
        best = (d + np.arange(chunks) // switch_every) % len(PATHS)
        c = 8 * (5.0 + rng.normal(0, 0.05, (chunks, len(PATHS))))
        c[np.arange(chunks), best] -= 8 * 0.5
        nll.append(c)
    first = [PATHS[d % len(PATHS)] for d in range(docs)]
    return cuts, first, nll


class Recorder:
    """A shard router that records what it reads."""

    def __init__(self):
        self.seen = []
        self.input = type("Input", (), {"tokens": 32})()

    def route_ids(self, ids):
        self.seen += [list(x) for x in ids]
        return [PATHS[sum(x) % 4] for x in ids]


def test_chunks_follow_the_context_and_stay_is_routing_once():
    cuts = chunk_cuts([list(range(20)), list(range(100))], context=32, w=16)
    assert cuts == [[], [(lo, min(lo + 16, 100)) for lo in range(32, 100, 16)]]
    assert decide(Rule("stay"), cuts, ["0-1", "1-0"], [[], []], PATHS) == [[], ["1-0"] * 5]


def test_the_shard_router_reads_the_tokens_before_each_chunk():
    ids = [list(range(100))]
    cuts = chunk_cuts(ids, 32, 16)
    rec = Recorder()
    got = decide(Rule("shard-router", lookback=24), cuts, ["0-0"], ids, PATHS, router=rec)
    assert rec.seen == [ids[0][lo - 24:lo] for lo, _ in cuts[0][1:]]
    assert got[0][0] == "0-0" and got[0][1:] == [PATHS[sum(s) % 4] for s in rec.seen]


def test_lagged_loss_follows_the_previous_chunk_beyond_its_margin():
    cuts = [[(0, 10), (10, 20), (20, 30), (30, 40)]]
    nll = [np.array([[50., 40., 60., 60.], [45., 50., 60., 60.], [30., 50., 60., 60.], [0., 0., 0., 0.]])]
    assert decide(Rule("lagged-loss", 0.0, 1), cuts, ["0-0"], [[]], PATHS, chunk_nll=nll)[0] == ["0-0", "0-1", "0-0", "0-0"]
    # a margin of 1.5 nats/token keeps the first path after chunk 0 (it is beaten by 1.0 only)
    assert decide(Rule("lagged-loss", 1.5, 1), cuts, ["0-0"], [[]], PATHS, chunk_nll=nll)[0] == ["0-0"] * 4
    # everything so far: after chunks 0-1, 0-0 has 95 against 90 for 0-1
    assert decide(Rule("lagged-loss", 0.0, 0), cuts, ["0-0"], [[]], PATHS, chunk_nll=nll)[0] == ["0-0", "0-1", "0-1", "0-0"]


def test_the_window_oracle_bounds_every_rule_and_the_best_is_chosen():
    cuts, first, nll = synthetic(docs=40, chunks=8)
    rules = candidates(8, 32, window_router=False)
    rules = [r for r in rules if r.kind != "shard-router"]  # no router in this fixture
    out = pick_window_rule(rules, cuts, first, [[]] * 40, PATHS, nll)
    assert out["chunks"] == 40 * 7 >= MIN_CHUNKS
    assert all(out["window_oracle"] <= v + 1e-12 for v in out["scores"].values())
    assert out["name"] == min(out["scores"], key=out["scores"].get) and out["chosen"]["kind"] == "lagged-loss"
    assert out["scores"][out["name"]] < out["scores"]["stay"]
    assert out["one_path"]["name"] == "stay"  # the only rule here that runs one path per chunk


def test_too_few_validation_chunks_keep_routing_once():
    cuts, first, nll = synthetic(docs=5, chunks=8)
    rules = [Rule("stay"), Rule("lagged-loss", 0.0, 1)]
    out = pick_window_rule(rules, cuts, first, [[]] * 5, PATHS, nll)
    assert out["scores"]["lagged-loss n=1 m=0"] < out["scores"]["stay"]  # it looks better, on 35 chunks
    assert out["name"] == "stay" and "too few" in out["reason"]


def test_routing_once_wins_when_nothing_beats_it():
    cuts, first, nll = synthetic(docs=40, chunks=8, switch_every=100)  # the first path stays best
    nll = [c + 0.0 for c in nll]
    for d, c in enumerate(nll):  # and the document's own path is the best one
        c[:, PATHS.index(first[d])] -= 8.0
    out = pick_window_rule([Rule("stay"), Rule("lagged-loss", 0.0, 1)], cuts, first, [[]] * 40, PATHS, nll)
    assert out["name"] == "stay" and "no rule beat" in out["reason"]
    assert total_nll(decide(Rule("stay"), cuts, first, [[]] * 40, PATHS), nll, PATHS) == pytest.approx(
        sum(c[:, PATHS.index(f)].sum() for c, f in zip(nll, first)))


def test_the_cross_fitted_oracle_chooses_on_one_half_and_scores_the_other():
    # path 0 is lucky on the odd targets, path 1 on the even ones; path 2 is good on both but never the best on either
    nll = np.array([[3.0, 0.0, 3.0, 0.0],
                    [0.0, 3.0, 0.0, 3.0],
                    [1.0, 1.0, 1.0, 1.0]])
    # even targets take the path best on the odd ones (0): 3 + 3; odd targets the path best on the even ones (1): 3 + 3
    assert cross_fitted_oracle_nll(nll) == 12.0
    assert nll.sum(axis=1).min() == 4.0  # the plain oracle (path 2) is not what the halves pick
    # with no luck to undo (one path best everywhere), the two oracles agree
    steady = np.array([[1.0, 2.0, 1.0], [2.0, 3.0, 2.0]])
    assert cross_fitted_oracle_nll(steady) == steady.sum(axis=1).min() == 4.0
    # noise alone: the plain oracle's lead over a fixed path is luck; the cross-fitted oracle has none on average
    rng = np.random.default_rng(0)
    noise = rng.normal(5.0, 1.0, (500, 4, 64))  # 500 chunks, 4 paths, 64 targets
    plain = np.mean([c.sum(axis=1).min() for c in noise]) / 64
    crossed = np.mean([cross_fitted_oracle_nll(c) for c in noise]) / 64
    assert plain < 4.9 and abs(crossed - 5.0) < 0.02  # the min of 4 sums sits ~1 sd (8/64 nats) below


def test_forward_passes_per_token_relative_to_routing_once():
    # only lagged-loss runs every path over the text; the routers read features, so they cost what routing once costs
    assert {r.name: r.forward_passes(4) for r in candidates(64, 32, True) if r.kind != "lagged-loss"} == \
        {"stay": 1, "shard-router L=32": 1, "shard-router L=64": 1, "window-router m=0": 1, "window-router m=0.1": 1,
         "window-router m=0.2": 1, "window-router m=0.4": 1}
    assert Rule("lagged-loss", 0.1, 2).forward_passes(4) == 4 and Rule("lagged-loss").forward_passes(16) == 16
    assert all(r.one_path == (r.forward_passes(4) == 1) for r in candidates(64, 32, True))
