"""Reports: JSON, a Markdown table, and PNG plots.

    report.json          {"methods": {name: {"perplexity", "tokens", "documents", "per_path", "per_label",
                          "round" | "rounds", "routing", ...}}, "early_stopping", "rounds_curve", ...}
    report.md            the tables below
    report.png           perplexity per method
    report_rounds.png    validation perplexity over rounds (when a run has several rounds in metrics.jsonl)
    report_paths.png     held-out documents per path for every routed method
"""

from __future__ import annotations

from pathlib import Path

from dipaco.io import write_json


def _f(x) -> str:
    return f"{x:.2f}" if x is not None else "n/a"


def markdown_table(report: dict) -> str:
    rows = ["| method | perplexity | scored tokens | documents | round | routing |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, m in report["methods"].items():
        r = m.get("round")
        r = r if r is not None else ("per path" if m.get("rounds") else "")
        rows.append(f"| {name} | {_f(m['perplexity'])} | {m['tokens']} | {m['documents']} | {r} | {m.get('routing', '')} |")
    labels = sorted({l for m in report["methods"].values() for l in m.get("per_label", {})})
    if labels:
        rows += ["", "| method | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
        for name, m in report["methods"].items():
            cells = [m.get("per_label", {}).get(l, {}).get("perplexity") for l in labels]
            rows.append(f"| {name} | " + " | ".join(_f(c) for c in cells) + " |")
    for run, picks in report.get("early_stopping", {}).items():
        rows += ["", f"early stopping ({run}): round per path: " + ", ".join(f"{p}: {r}" for p, r in picks.items())]
    return "\n".join(rows)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path, title: str, ylabel: str, xlabel: str = "", legend_size: int = 0) -> None:
    """Every plot here ends alike: axis labels, title, legend if asked, then the PNG."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend_size:
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(report: dict, path: str | Path) -> None:
    plt = _plt()
    names = list(report["methods"])
    values = [report["methods"][n]["perplexity"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names)), 3.4))
    bars = ax.bar(range(len(names)), values, color="#4878a8")
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    _save(plt, fig, ax, path, "perplexity per method", "held-out perplexity (prefix not scored)")


def plot_rounds(report: dict, path: str | Path) -> bool:
    curves = report.get("rounds_curve")
    if not curves:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for run, rows in curves.items():
        rounds = [int(r) for r in rows]
        many = len(next(iter(rows.values()))["per_path"]) > 1
        ax.plot(rounds, [rows[r]["val_perplexity"] for r in rows], marker="o",
                label=f"{run} (mean over paths)" if many else run)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_yscale("log")
    _save(plt, fig, ax, path, "perplexity over rounds", "validation perplexity", "round (outer step)", legend_size=8)
    return True


def plot_paths(report: dict, path: str | Path) -> bool:
    # the once-routed row of every routed run, with its oracle beside it: where the router sends documents
    routed = {n: m["per_path"] for n, m in report["methods"].items() if len(m.get("per_path", {})) > 1
              and ((m.get("routing") == "once" and not m.get("rounds")) or n.endswith(" oracle"))}
    if not routed:
        return False
    plt = _plt()
    paths = sorted({p for pp in routed.values() for p in pp})
    fig, ax = plt.subplots(figsize=(min(16, max(4, 0.35 * len(paths) * len(routed) + 2)), 3.4))
    width = 0.8 / len(routed)
    for i, (name, pp) in enumerate(routed.items()):
        ax.bar([k + i * width for k in range(len(paths))], [pp.get(p, {}).get("documents", 0) for p in paths],
               width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(paths))], paths)
    _save(plt, fig, ax, path, "held-out documents per path", "held-out documents", "path", legend_size=7)
    return True


def beside(out: Path) -> list[Path]:
    """The files ``write_report`` writes beside ``out`` (checked before any work: dipaco/storage/outputs.py)."""
    return [out.with_suffix(".md"), out.with_suffix(".png"), out.with_name(out.stem + "_rounds.png"),
            out.with_name(out.stem + "_paths.png")]


def write_report(report: dict, out: str | Path) -> dict[str, str]:
    """report.json at ``out``, plus report.md and the PNG plots beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    md, png, rounds, paths = beside(out)
    md.write_text(markdown_table(report) + "\n")
    plot(report, png)
    files = {"json": str(out), "markdown": str(md), "plot": str(png)}
    if plot_rounds(report, rounds):
        files["rounds_plot"] = str(rounds)
    if plot_paths(report, paths):
        files["paths_plot"] = str(paths)
    return files
