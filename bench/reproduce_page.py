"""docs/RESULTS.md, the README's results lines and the plots of bench/reproduce.py, all written from measured
numbers (``reproduce_report.collect``): nothing on the page is typed by hand, so no line goes stale."""

from __future__ import annotations

from pathlib import Path

from reproduce_corpus import CURVES, DOWNSTREAM_TASK, HEADLINE, PAPER_OUTER, PRIVATE, Scale
from reproduce_report import MISSING

README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"


def fmt(x, p=2) -> str:
    return MISSING if x is None else f"{x:,.{p}f}"


def opt(x, p=2) -> str:
    """A number that a row may not have (a bound not computed): "-" when absent."""
    return "-" if x is None else f"{x:,.{p}f}"


def pct(a, b) -> str:
    return f"{100 * (a / b - 1):+.1f}%"


def held(e: dict) -> str:
    return "yes" if e["held"] else "-" if e["held"] is None else "**no**"


def unchecked(expectations: list[dict]) -> str:
    """" (k not yet run; m not measured at this scale)" for the expectations without a verdict, or ""."""
    missing = sum(e["held"] is None and e["measured"] == MISSING for e in expectations)
    other = sum(e["held"] is None for e in expectations) - missing
    parts = [f"{missing} {MISSING}"] * bool(missing) + [f"{other} not measured at this scale"] * bool(other)
    return f" ({'; '.join(parts)})" if parts else ""


def summary(name: str, res: dict, s: Scale, lead_plot: str | None = None) -> list[str]:
    """The page's prose for one corpus: sentences built from the numbers (a missing number leaves its sentence out)."""
    runs, head, lines = res["runs"], (res.get("headline") or {}).get("run"), []
    dense = runs["dense"].get("perplexity")
    if head and dense:
        h = runs[head]
        gap = 100 * (1 - h["perplexity"] / dense)
        vals = ", ".join(f"{runs[n]['label']} {fmt(v)}" for n, v in res["headline"]["chosen_on_validation"].items())
        verdict = ("so `dipaco_below_dense_5pct` holds" if gap >= 5 else
                   f"{5 - gap:.1f} points short of the 5% expected (`dipaco_below_dense_5pct` fails); the per-round lead "
                   f"over dense ([lead_{name}.png]({lead_plot or f'results/lead_{name}.png'}), and the next line) shows where it goes")
        lines.append(f"- Headline: **{h['label']}** (chosen on validation perplexity among {vals}) ends {fmt(h['perplexity'])} "
                     f"against {fmt(dense)} for dense at the same steps per path: {gap:.1f}% below dense, {verdict}.")
    lead = res["lead"]
    parts = []
    for n in CURVES[1:]:
        pts = [(k, v) for k, v in zip(lead[n]["rounds"], lead[n]["lead_pct"]) if k and v is not None]
        if len(pts) >= 2:
            peak = max(pts, key=lambda kv: kv[1])
            parts.append(f"{runs[n]['label']}: {pts[0][1]:+.1f}% after round {pts[0][0]}, at most {peak[1]:+.1f}% "
                         f"(round {peak[0]}), {pts[-1][1]:+.1f}% after round {pts[-1][0]}")
    if parts:
        lines.append("- Lead over dense per round (% below dense, held-out documents): " + "; ".join(parts) + ".")
    base = runs["dipaco-2x2"]
    for n, what in (("dipaco-2x2-private", "path-private modules (the paper's recipe)"), ("dipaco-2x2-overlap", "top-2 overlap in training")):
        r = runs[n]
        if r.get("perplexity") and base.get("perplexity"):
            lines.append(f"- {what.capitalize()}: {r['label']} ends {fmt(r['perplexity'])} ({pct(r['perplexity'], base['perplexity'])} "
                         f"against DiPaCo 2x2) with {fmt(r.get('parameters_total'), 0)} parameters in all "
                         f"({fmt(r.get('parameters_per_path'), 0)} per path; DiPaCo 2x2: {fmt(base.get('parameters_total'), 0)}, "
                         f"flat mixture: {fmt(runs['flat-4'].get('parameters_total'), 0)}).")
    rt = res["routing"].get(head) if head else None
    if rt and rt["every"] is not None:
        one = ("the same rule (it runs one path)" if rt["one_path_rule"] == rt["every_rule"] else
               f"its one-path variant ({rt['one_path_rule']}) {fmt(rt['one_path'])}")
        lines.append(f"- Routing ({rt['label']}): once by the run's saved rule ({rt['once_rule']}) {fmt(rt['once'])}; every "
                     f"{s.route_every} tokens by the rule chosen on the router documents ({rt['every_rule']}, "
                     f"{rt['forward_passes']}x the forward passes of routing once) {fmt(rt['every'])}; {one}; "
                     f"document oracle {fmt(rt['oracle'])}.")
    checked = [e for e in res["expectations"] if e["held"] is not None]
    lines.append(f"- Expectations: {sum(e['held'] for e in checked)} of {len(checked)} checked hold"
                 + unchecked(res["expectations"]) + ".")
    return lines


def corpus_block(name: str, res: dict, s: Scale, pictures: dict[str, str]) -> str:
    p, W = res["pretrain"], s.route_every
    lines = [f"## Corpus: {name}", "", *summary(name, res, s, pictures.get("lead")), "",
             f"Start: {fmt(p['parameters'], 0)} parameters per path, {fmt(p['steps'], 0)} steps, "
             f"{fmt(res['pretrain_tokens_per_param'], 1)} tokens per parameter, peak lr {p['lr'] if p['lr'] else MISSING} "
             f"(pilot, validation loss after {s.pretrain_pilot_rounds * s.pretrain_H} steps: "
             + ", ".join(f"{k}: {fmt(v, 3)}" for k, v in p["lr_pilot"].items())
             + f"); held-out perplexity {fmt(p['heldout_perplexity'])}. Continued runs: {s.rounds} rounds of H = {s.H}.", ""]
    if pictures.get("pretrain"):
        lines += [f"![pretraining validation curve]({pictures['pretrain']})", ""]
    lines += [f"Outer optimizer grid (DiPaCo 2x2, {s.pilot_rounds} rounds from the start; routed perplexity on the validation "
              f"documents; chosen: **{res['outer_chosen'] or MISSING}**; the papers': {list(PAPER_OUTER)}):", "",
              "| outer lr | momentum | validation ppl |", "| ---: | ---: | ---: |"]
    lines += [f"| {g['lr']} | {g['momentum']} | {fmt(g['val_perplexity'])} |" for g in res["outer_grid"]]
    lines += ["", "| run | held-out ppl | validation ppl | params total | params/path | steps/trainee | trainees (workers) "
                  "| bytes sent | x fewer than DP bf16 | train s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
              f"| pretrained start (all runs) | {fmt(p['heldout_perplexity'])} | | | | | | | | |"]
    head = (res.get("headline") or {}).get("run")
    for n, r in res["runs"].items():
        label = r["label"] + (" (headline)" if n == head else "") + (" (the same run: the grid chose it)" if r.get("same_run_as") else "")
        ppl = "n/a" if r["bytes_only"] else fmt(r.get("perplexity"))
        lines.append(f"| {label} | {ppl} | {fmt(r.get('val_perplexity')) if n in res['routing'] else '-'} | "
                     f"{fmt(r.get('parameters_total'), 0)} | {fmt(r.get('parameters_per_path'), 0)} | {r['steps_per_trainee']} | "
                     f"{r['trainees']} ({r.get('workers', '-')}) | {fmt(r.get('bytes_sent'), 0)} | "
                     f"{fmt(r.get('bytes_ratio_vs_dp'), 0) if (r.get('workers') or 1) > 1 else '-'} | {fmt(r.get('train_seconds'), 0)} |")
    lines += ["", f"Private modules: {', '.join(f'`{x}`' for x in PRIVATE)} (the paper keeps the embedding and blocks 0, 5, 6 "
                  f"and 11 of its 12 private; here the embedding, tied with the output head, and the first and last of 4 "
                  f"blocks). Overlap: the 2x2 shards written with `--overlap 2` (every training document on its 2 nearest "
                  f"paths; never at evaluation). The headline row is chosen among {', '.join(HEADLINE)} on validation "
                  f"perplexity, never on held-out documents.", "",
              f"Routing (held-out; once: the run's saved once rule, chosen on the router documents; every-{W}: the rule "
              f"chosen on the router documents; forward passes per token relative to routing once):", "",
              f"| run | once | once rule | every-{W} | every-{W} rule | forward passes | one-path every-{W} | one-path rule "
              f"| mixture-2 | oracle | window oracle |", "| --- | ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for n, rt in res["routing"].items():
        lines.append(f"| {rt['label']} | {fmt(rt['once'])} | {rt['once_rule']} | {fmt(rt['every'])} | {rt['every_rule']} | "
                     f"{rt['forward_passes']}x | {fmt(rt['one_path'])} | {rt['one_path_rule']} | {opt(rt['mixture-2'])} | "
                     f"{opt(rt['oracle'])} | {opt(rt[f'window-oracle-{W}'])} |")
    labels = sorted({k for r in res["runs"].values() for k in r.get("per_label") or {}})
    if labels:
        lines += ["", "Held-out perplexity per domain:", "", "| run | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
        lines += [f"| {r['label']} | " + " | ".join(fmt(r["per_label"].get(k)) for k in labels) + " |"
                  for r in res["runs"].values() if r.get("per_label")]
    lines += downstream_table(res)
    lines += ["", "Expectations:", "", "| id | claim | held? | measured |", "| --- | --- | --- | --- |"]
    lines += [f"| `{e['id']}` | {e['claim']} | {held(e)} | {e['measured']} |" for e in res["expectations"]]
    for key, alt in (("lead", "per-round held-out perplexity and lead over dense"), ("rounds", "held-out perplexity over training")):
        if pictures.get(key):
            lines += ["", f"![{alt}]({pictures[key]})"]
    return "\n".join(lines) + "\n"


def downstream_table(res: dict) -> list[str]:
    """The held-out multiple-choice task through lm-evaluation-harness (bench/reproduce.py --downstream)."""
    rows = res.get("downstream") or {}
    if not rows:
        return []
    t = next((r for r in rows.values() if "task" in r), DOWNSTREAM_TASK)
    head = (res.get("headline") or {}).get("run")
    lines = ["", f"Downstream (lm-evaluation-harness, `dipaco lm-eval`): a held-out document's first {t['passage']} "
                 f"tokens and {t['choices']} continuations of {t['answer']} tokens, its own and those at the same place "
                 f"of other held-out documents of the same domain; each question routed by its passage, every choice by "
                 f"that path (chance: 1/{t['choices']}). Accuracy ± the harness's standard error:", "",
             "| run | held-out ppl | accuracy | length-normalised accuracy | questions |", "| --- | ---: | ---: | ---: | ---: |"]
    other, gap = [], 0.0
    for n, r in rows.items():
        label = r["label"] + (" (headline)" if n == head else "")
        if "acc" not in r:
            lines.append(f"| {label} | {fmt(r.get('perplexity'))} | {MISSING} | | |")
            continue
        mark = "†" if r.get("same_weights") is False else ""
        if mark:
            other.append(f"{r['label']} {fmt(r.get('row_perplexity'))}")
            if r.get("perplexity") and r.get("row_perplexity"):
                gap = max(gap, abs(r["perplexity"] / r["row_perplexity"] - 1))
        lines.append(f"| {label} | {fmt(r.get('perplexity'))}{mark} | {r['acc']:.3f} ± {r['acc_stderr']:.3f} | "
                     f"{r['acc_norm']:.3f} ± {r['acc_norm_stderr']:.3f} | {r['questions']} |")
    if other:
        lines += ["", "† re-trained for this table, to other weights than the main table's row (the durable results' "
                      "weights_sha256: same code and shard bytes, another machine); perplexity and accuracy here are both "
                      "of the re-trained model. The main table's perplexity: " + "; ".join(other) +
                      f" (at most {100 * gap:.1f}% apart)."]
    return lines


def page(results: dict, s: Scale, pictures: dict[str, dict[str, str]], command: str) -> str:
    corpora = results["corpora"]
    intro = [
        "# Results: DiPaCo against dense in the papers' regime, at CPU scale", "",
        f"This page is written by `{command}` from the durable job results in `results/jobs/` (one JSON per finished "
        f"job); every sentence and number below comes from them. Rows whose job has not run say \"{MISSING}\".", "",
        f"Protocol (scale `{results['scale_name']}`): one dense start per corpus, its peak lr chosen on validation loss "
        f"among {s.pretrain_lrs}; then every row continues from it for {s.rounds} outer rounds of H = {s.H} inner steps, at "
        f"the start's final lr (no re-warm). The outer step (lr, Nesterov momentum) is chosen on validation documents "
        f"among {s.outer_grid}. Held-out documents are cut to {s.eval_tokens} tokens; the first 32 route and are never "
        f"scored, the same tokens for every row. Dense, the flat mixture, DiPaCo 2x2 and its private-module variant are "
        f"evaluated after every round (the lead plot); the other rows every {s.eval_every} rounds.", ""]
    return "\n".join(intro) + "\n" + "\n".join(corpus_block(n, r, s, pictures.get(n, {})) for n, r in corpora.items())


def readme_lines(results: dict) -> str:
    """The README's results lines: one per corpus, with the headline and the checks, linking the page."""
    import textwrap

    intro = ("[docs/RESULTS.md](docs/RESULTS.md) runs the papers' comparison at CPU scale; these lines and the page are "
             "written by `python bench/reproduce.py --page docs/RESULTS.md` from the durable job results in "
             "docs/results/jobs/ (shared / default corpus):")
    out = textwrap.wrap(intro, 115) + [""]
    for name, res in results["corpora"].items():
        checked = [e for e in res["expectations"] if e["held"] is not None]
        head = (res.get("headline") or {}).get("run")
        runs = res["runs"]
        dense = runs["dense"].get("perplexity")
        below = lambda r: f"{100 * (1 - runs[r]['perplexity'] / dense):.1f}%"  # noqa: E731
        if head and dense:
            h = runs[head]
            text = (f"{h['label']} (headline, chosen on validation; {h['parameters_total']:,} parameters in all, "
                    f"{h['parameters_per_path']:,} per path) is {below(head)} below dense at the same steps per path "
                    f"({fmt(h['perplexity'])} vs {fmt(dense)}; 5% expected)")
            if head != "dipaco-2x2" and runs["dipaco-2x2"].get("perplexity"):
                text += f"; DiPaCo 2x2 with every module shared: {below('dipaco-2x2')}"
            down = res.get("downstream") or {}
            if all("acc" in down.get(r, {}) for r in (head, "dense")):
                acc = lambda r: f"{down[r]['acc']:.3f}\u00a0±\u00a0{down[r]['acc_stderr']:.3f}"  # noqa: E731 (kept on one line)
                text += f"; held-out multiple choice (lm-evaluation-harness) {acc(head)} vs dense {acc('dense')}"
        else:
            text = f"the headline DiPaCo row is {MISSING}"
        failed = [f"`{e['id']}`" for e in checked if not e["held"]]
        text += (f"; {sum(e['held'] for e in checked)} of {len(checked)} checks hold" + unchecked(res["expectations"])
                 + (f" (not: {', '.join(failed)})" if failed else "") + ".")
        out += textwrap.wrap(f"- {name}: {text}", 115, subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(out)


def write_readme(readme: Path, block: str) -> bool:
    """Replace the README's results lines between the markers; False (untouched) when the README has no markers."""
    text = readme.read_text() if readme.is_file() else ""
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{block}\n{README_END}{rest.split(README_END, 1)[1]}")
    return True


def plots(name: str, res: dict, folder: Path) -> dict[str, str]:
    """pretrain_<corpus>.png, rounds_<corpus>.png and lead_<corpus>.png, for what has been measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    c = res["pretrain"]["curve"]
    if c:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot([x["tokens_per_param"] for x in c], [x["val_perplexity"] for x in c], marker="o", ms=2)
        ax.set(xlabel="tokens per parameter", ylabel="validation perplexity (dense start)", yscale="log",
               title=f"{name}: the start saturates")
        ax.grid(alpha=0.3)
        files["pretrain"] = _save(fig, folder / f"pretrain_{name}.png")
    curves = {r["label"]: (r["curve"], r["H"], r["trainees"]) for r in res["runs"].values() if len((r.get("curve") or {}).get("rounds", [])) > 1}
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
        for label, (cv, H, trainees) in curves.items():
            steps = [k * H for k in cv["rounds"]]
            axes[0].plot(steps, cv["perplexity"], label=label, marker="o", ms=2)
            axes[1].plot([x * trainees for x in steps], cv["perplexity"], label=label, marker="o", ms=2)
        axes[0].set(xlabel="inner steps per trainee", ylabel="routed held-out perplexity")
        axes[1].set(xlabel="inner steps of all trainees together (compute)", xscale="symlog")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        fig.suptitle(f"{name}: every run continues from the same dense start")
        files["rounds"] = _save(fig, folder / f"rounds_{name}.png")
    lead = {n: v for n, v in res["lead"].items() if len(v["rounds"]) > 1}
    if lead:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        for i, (n, v) in enumerate(lead.items()):
            style = {"label": res["runs"][n]["label"], "marker": "o", "ms": 2, "color": f"C{i}"}  # one colour per row
            axes[0].plot(v["rounds"], v["perplexity"], **style)
            if n != "dense":
                axes[1].plot(v["rounds"], v["lead_pct"], **style)
        axes[1].axhline(5, color="grey", ls="--", lw=1, label="5% (expected of DiPaCo)")
        axes[0].set(xlabel="outer round", ylabel="held-out perplexity")
        axes[1].set(xlabel="outer round", ylabel="lead over dense (% below dense)")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            ax.xaxis.get_major_locator().set_params(integer=True)
        fig.suptitle(f"{name}: held-out perplexity after every round, and the lead over dense")
        files["lead"] = _save(fig, folder / f"lead_{name}.png")
    return files


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
