"""The results of bench/reproduce.py, read from the durable job results alone: the numbers per corpus, the
expectations, and the page, README lines and plots written from them (a row whose job has not run says so)."""

from __future__ import annotations

import math
from dataclasses import asdict

from reproduce_corpus import CURVES, PAPER_OUTER, Corpus, Scale, paths_of, pretrain_tokens_per_step
from reproduce_store import method

MISSING = "not yet run"


def dp_bytes(per_path: int, replicas: int, steps: int) -> int:
    """Bytes all workers send when ``replicas`` data-parallel copies all-reduce bf16 gradients every step: a
    reduce-scatter + all-gather, 2(n−1)/n of the gradient per replica."""
    from dipaco.training.comm import allreduce_bytes

    return replicas * allreduce_bytes(per_path, replicas, 16) * steps


def collect(c: Corpus) -> dict:
    """Everything the page shows for one corpus, from the durable results of its jobs."""
    s = c.s
    start = c.result("start")
    per_path = ((start or {}).get("run_info", {}).get("parameters") or {}).get("per_path")
    per_step = pretrain_tokens_per_step(s)
    curve = [{"round": r["round"], "steps": r["round"] * s.pretrain_H,
              "tokens_per_param": r["round"] * s.pretrain_H * per_step / per_path, "val_perplexity": math.exp(r["val_loss_mean"])}
             for r in (start or {}).get("rounds", []) if per_path and r.get("val_loss_mean") is not None]
    start_ppl = method(start, "heldout", "pretrained start").get("perplexity")
    res = {"pretrain": {"lr_pilot": {f"{k:g}": v for k, v in c.pretrain_pilot().items()}, "lr": c.start_lr(),
                        "steps": s.pretrain_rounds * s.pretrain_H, "parameters": per_path, "curve": curve,
                        "heldout_perplexity": start_ppl},
           "pretrain_tokens_per_param": curve[-1]["tokens_per_param"] if curve else None,
           "outer_grid": c.outer_grid(), "outer_chosen": list(c.chosen_outer() or []) or None, "runs": {}, "routing": {},
           "scored_tokens": method(start, "heldout", "pretrained start").get("tokens")}
    for sp in c.specs():
        res["runs"][sp.name] = row = _row(c, sp, start_ppl)
        if sp.routing and row["status"] == "done":
            res["routing"][sp.name] = _routing(c.result(sp.name), sp, s.route_every)
    head = c.headline()
    res["headline"] = {"run": head, "chosen_on_validation": c.validation_perplexities()} if head else None
    res["lead"] = _lead(res["runs"])
    res["downstream"] = {n: _downstream(c, n, res["runs"][n]) for n in c.downstream_rows()} if c.downstream else {}
    res["expectations"] = expectations(res, s)
    return res


def _downstream(c: Corpus, name: str, row: dict) -> dict:
    """A row of the downstream table: held-out perplexity and multiple-choice accuracy of the weights the downstream job
    scored, and whether those are the weights the main table's row was measured on (a row re-trained for it on
    another machine may not be: the same code and shard bytes gave other weights there)."""
    job = c.result(f"downstream-{name}") or {}
    kept = (job.get("evals") or {}).get("heldout_choice")
    if not kept:
        return {"label": row["label"], "perplexity": row.get("perplexity"), "status": MISSING}
    trained = (c.result(row.get("same_run_as", name)) or {}).get("weights_sha256")
    same = None if not (trained and job.get("weights_sha256")) else trained == job["weights_sha256"]
    return {"label": row["label"], "perplexity": method(job, "heldout", row["label"]).get("perplexity"),
            "row_perplexity": row.get("perplexity"), **kept, "same_weights": same}


def _row(c: Corpus, sp, start_ppl: float | None) -> dict:
    row = {"label": sp.label, "shards": sp.shards, "settings": sp.sets, "rounds": sp.rounds, "H": sp.H,
           "steps_per_trainee": sp.rounds * sp.H, "trainees": sp.trainees, "bytes_only": sp.bytes_only, "status": MISSING}
    r = c.result(sp.name)
    if r is None:
        return row
    rec = r.get("record", {})
    if rec.get("same_run_as"):
        row["same_run_as"] = rec["same_run_as"]
        r = c.result(rec["same_run_as"])
        if r is None:
            return row
    row["status"], row["outer"] = "done", rec.get("outer_step")
    label = r["record"]["label"]
    info = r.get("run_info", {})
    if info.get("parameters"):
        row |= {"workers": info.get("workers"), "parameters_total": info["parameters"]["total"],
                "parameters_per_path": info["parameters"]["per_path"]}
    rows = r.get("rounds", [])
    if rows:
        sent = sum(x.get("bytes_sent") or 0 for x in rows)
        dp = dp_bytes(row["parameters_per_path"], sp.trainees, sp.rounds * sp.H) if (info.get("workers") or 1) > 1 else 0
        row |= {"train_seconds": sum(x.get("seconds") or 0 for x in rows), "bytes_sent": sent,
                "bytes_ratio_vs_dp": dp / sent if sent and dp else None}
    final = method(r, f"heldout_r{sp.rounds}", label)
    row |= {"perplexity": final.get("perplexity"), "scored_tokens": final.get("tokens"), "per_label": final.get("per_label", {}),
            "val_perplexity": method(r, "val", label).get("perplexity")}
    rounds = sorted(int(k.split("_r")[1]) for k in r.get("evals", {}) if k.startswith("heldout_r"))
    row["curve"] = {"rounds": [0] * (start_ppl is not None) + rounds,
                    "perplexity": [start_ppl] * (start_ppl is not None) + [method(r, f"heldout_r{k}", label).get("perplexity") for k in rounds]}
    return row


def _routing(r: dict, sp, w: int) -> dict:
    """Today's routing of one row: once by the run's saved once rule, every-W by the rule chosen on the router
    documents with its compute, its one-path variant, and the bounds."""
    label, key, paths = sp.label, f"heldout_r{sp.rounds}", paths_of((r.get("run_info") or {}).get("grid"))
    once, every = method(r, key, label), method(r, key, f"{label} every-{w}")
    policy = every.get("policy") or {}
    one = method(r, key, f"{label} every-{w} one-path")
    single = policy.get("one_path") or {}
    if not one and single.get("name") == policy.get("name"):
        one = every  # the chosen rule runs one path already
    out = {"label": label, "paths": paths, "once": once.get("perplexity"), "once_rule": (once.get("once_policy") or {}).get("name"),
           "every": every.get("perplexity"), "every_rule": policy.get("name"), "every_reason": policy.get("reason"),
           "forward_passes": every.get("forward_passes"), "one_path": one.get("perplexity"),
           "one_path_rule": single.get("name"), "one_path_forward_passes": single.get("forward_passes", 1),
           "val_once": method(r, "val", label).get("perplexity"), "val_every": method(r, "val", f"{label} every-{w}").get("perplexity"),
           "window_router": r.get("window_router") or {}}
    for extra in ("shard-router", "early-stop", "mixture-2", "random", "oracle", f"window-oracle-{w}"):
        out[extra] = method(r, key, f"{label} {extra}").get("perplexity")
    return out


def _lead(runs: dict) -> dict:
    """Per evaluated round, held-out perplexity of the CURVES rows and each one's lead over dense (% below it)."""
    dense = runs["dense"].get("curve") or {}
    at = dict(zip(dense.get("rounds", []), dense.get("perplexity", [])))
    out = {}
    for name in CURVES:
        cv = runs[name].get("curve") or {}
        pairs = [(k, p) for k, p in zip(cv.get("rounds", []), cv.get("perplexity", [])) if p is not None]
        out[name] = {"rounds": [k for k, _ in pairs], "perplexity": [p for _, p in pairs],
                     "lead_pct": [100 * (1 - p / at[k]) if at.get(k) else None for k, p in pairs]}
    return out


EXPECTATIONS = [
    ("diloco_below_dense", "DiLoCo (4 replicas, k-means shards) below dense at the same steps per trainee"),
    ("dipaco_below_dense_5pct", "the headline DiPaCo 2x2 row (chosen on validation) at least 5% below dense at the same steps per path"),
    ("dipaco_near_dense_px", "the headline DiPaCo 2x2 row within 3% of dense with 4x the steps"),
    ("dipaco_4x4_below_2x2", "DiPaCo 4x4 below DiPaCo 2x2"),
    ("every64_below_once", "the headline row routed every 64 tokens (the rule chosen on the router documents) at or below "
                           "routing once (the run's saved once rule)"),
    ("discriminative_not_worse", "DiPaCo 2x2 after discriminative re-sharding not worse than on k-means shards"),
    ("fourbit_within_1pct", "Streaming DiPaCo 2x2 in 4 bits within 1% (perplexity) of the same run in fp32"),
    ("bytes_400x", "Streaming 4-bit DiPaCo at the papers' H = 100 sends at least 400x fewer bytes than bf16 data-parallel "
                   "of one path on as many workers"),
]


def expectations(res: dict, s: Scale) -> list[dict]:
    runs, head = res["runs"], (res.get("headline") or {}).get("run")
    ppl = {k: v.get("perplexity") for k, v in runs.items()}

    def cmp(a, b, factor):
        if a is None or ppl.get(a) is None or ppl.get(b) is None:
            return None, MISSING
        return ppl[a] <= factor * ppl[b], f"{ppl[a]:.2f} vs {ppl[b]:.2f} ({100 * (ppl[a] / ppl[b] - 1):+.1f}%)"

    out = {"diloco_below_dense": cmp("diloco-kmeans", "dense", 1.0), "dipaco_below_dense_5pct": cmp(head, "dense", 0.95),
           "dipaco_near_dense_px": cmp(head, "dense-4x", 1.03), "dipaco_4x4_below_2x2": cmp("dipaco-4x4", "dipaco-2x2", 1.0),
           "discriminative_not_worse": cmp("dipaco-2x2-disc", "dipaco-2x2", 1.0),
           "fourbit_within_1pct": cmp("stream-4bit", "stream-fp32", 1.01)}
    for k in ("dipaco_below_dense_5pct", "dipaco_near_dense_px"):
        if out[k][0] is not None:
            out[k] = (out[k][0], f"{runs[head]['label']}: {out[k][1]}")
    if out["diloco_below_dense"][0] is not None and ppl.get("diloco-iid"):
        out["diloco_below_dense"] = (out["diloco_below_dense"][0], out["diloco_below_dense"][1] + f"; i.i.d. shards: {ppl['diloco-iid']:.2f}")
    rt = res["routing"].get(head) if head else None
    if rt and rt["every"] is not None and rt["once"] is not None:
        out["every64_below_once"] = (rt["every"] <= rt["once"], f"{rt['every']:.2f} vs {rt['once']:.2f} ({rt['label']}, "
                                     f"{rt['every_rule']}, {rt['forward_passes']}x the forward passes)")
    else:
        out["every64_below_once"] = (None, MISSING)
    ratio, main = runs["bytes-4bit-h100"].get("bytes_ratio_vs_dp"), runs["stream-4bit"].get("bytes_ratio_vs_dp")
    if not ratio:
        out["bytes_400x"] = (None, MISSING if runs["bytes-4bit-h100"]["status"] != "done" else
                             f"not measured: the streaming runs use {s.stream_workers} worker(s) at this scale, no bytes cross a wire")
    else:
        out["bytes_400x"] = (ratio >= 400, f"{ratio:.0f}x at H = {2 * s.H}" + (
        f"; {main:.0f}x in the main run at H = {s.H}" if main else ""))
    return [{"id": i, "claim": claim, "held": out[i][0], "measured": out[i][1]} for i, claim in EXPECTATIONS]


def results_json(corpora: list[Corpus], collected: dict[str, dict], scale_name: str, s: Scale) -> dict:
    return {"scale_name": scale_name, "scale": asdict(s), "outer_rounds": s.rounds, "corpora": collected,
            "pretrain_tokens_per_param": {k: v["pretrain_tokens_per_param"] for k, v in collected.items()},
            "expectations": [{**e, "corpus": k} for k, v in collected.items() for e in v["expectations"]],
            "missing": {c.name: [n for n, r in collected[c.name]["runs"].items() if r["status"] != "done"] for c in corpora}}
