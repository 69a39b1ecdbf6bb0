"""Reports: JSON, a Markdown table, and a PNG bar chart of perplexity per method."""

from __future__ import annotations

from pathlib import Path

from dipaco.io import write_json


def markdown_table(report: dict) -> str:
    rows = ["| method | perplexity | scored tokens | documents | round |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in report["methods"].items():
        ppl = f"{m['perplexity']:.2f}" if m["perplexity"] is not None else "n/a"
        rows.append(f"| {name} | {ppl} | {m['tokens']} | {m['documents']} | {m.get('round', '')} |")
    labels = sorted({l for m in report["methods"].values() for l in m.get("per_label", {})})
    if labels:
        rows += ["", "| method | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
        for name, m in report["methods"].items():
            cells = [m.get("per_label", {}).get(l, {}).get("perplexity") for l in labels]
            rows.append(f"| {name} | " + " | ".join(f"{c:.2f}" if c else "n/a" for c in cells) + " |")
    return "\n".join(rows)


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["methods"])
    values = [report["methods"][n]["perplexity"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(names)), 3.2))
    bars = ax.bar(names, values, color="#4878a8")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("held-out perplexity (prefix not scored)")
    ax.set_title("routed perplexity per method")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: str | Path) -> dict[str, str]:
    """report.json at ``out``, plus report.md and report.png beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(markdown_table(report) + "\n")
    plot(report, png)
    return {"json": str(out), "markdown": str(md), "plot": str(png)}
