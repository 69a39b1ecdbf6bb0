"""``dipaco inspect SHARDS``: a readable summary per path, and a PNG of path sizes when asked for (``--png``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dipaco.routing import Router
from dipaco.storage.shards import ShardSet


def top_terms(router, n: int = 8) -> dict[str, list[str]] | None:
    """For a tf-idf router: the terms that weigh most in each path's direction (centroids or classifier
    rows projected back through the SVD). None for model features."""
    features = router.features
    if getattr(features, "kind", None) != "tfidf" or features.vectorizer is None:
        return None
    vocab = features.vectorizer.vocabulary_
    terms = np.empty(len(vocab), dtype=object)
    for term, i in vocab.items():
        terms[i] = term
    paths = router.paths
    vectors = np.zeros((len(paths), features.components.shape[0]), dtype=np.float32)
    if router.kind == "kmeans":
        for idx, combo in enumerate(np.ndindex(*router.shape)):
            for level, k in enumerate(combo):
                vectors[idx, router.dims[level]] = router.centroids[level][k]
    else:
        vectors = router.coef
    weights = vectors @ features.components  # (paths, vocabulary)
    return {p: [str(terms[j]) for j in np.argsort(-w, kind="stable")[:n]] for p, w in zip(paths, weights)}


def openings(shards: ShardSet, path: str, n: int = 2, chars: int = 70) -> list[str]:
    tok = shards.tokenizer()
    tokens, offsets = shards.tokens(path), shards.doc_offsets(path)
    out = []
    for a, b in zip(offsets[:n].tolist(), offsets[1:n + 1].tolist()):
        text = tok.decode(np.asarray(tokens[a:min(b, a + 48)]).tolist())
        out.append(" ".join(text.split())[:chars])
    return out


def inspect(shards_dir: str | Path, png: str | Path | None = None, terms: int = 8) -> dict:
    """Per-path summary (documents, tokens, share, top labels, top terms, sample openings), and a PNG at ``png``
    if given."""
    shards = ShardSet(shards_dir)
    m = shards.manifest
    router = Router.load(shards.root / "router")
    tops = top_terms(router, terms)
    total = sum(s["train_docs"] + s["val_docs"] for s in m["paths"].values()) or 1
    rows = []
    for p, s in m["paths"].items():
        labels = m.get("labels_per_path", {}).get(p, {})
        label_total = sum(labels.values())
        top_labels = [f"{l} {c / label_total:.0%}" for l, c in sorted(labels.items(), key=lambda kv: -kv[1])[:2]]
        rows.append({"path": p, "docs": s["train_docs"] + s["val_docs"], "train_tokens": s["train_tokens"],
                     "val_tokens": s["val_tokens"], "share": (s["train_docs"] + s["val_docs"]) / total,
                     "labels": top_labels, "terms": tops[p] if tops else None,
                     "openings": openings(shards, p) if s["train_docs"] else []})
    summary = {"shards": str(shards.root), "grid": shards.grid, "router": router.kind,
               "features": router.features.describe().get("kind") if router.features is not None else router.kind, "paths": rows,
               "path_sizes": m.get("path_sizes"), "dropped": m.get("dropped"), "reshard": m.get("reshard")}
    summary["png"] = None if png is None else str(plot_sizes(rows, png, f"{shards.root.name}: grid {shards.grid}, "
                                                                          f"{router.kind} router"))
    return summary


def plot_sizes(rows: list[dict], png: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(rows) + 2), 3.2))
    ax.bar([r["path"] for r in rows], [r["train_tokens"] for r in rows], color="#4c72b0")
    ax.set_xlabel("path")
    ax.set_ylabel("training tokens")
    ax.set_title(title, fontsize=9)
    if len(rows) > 12:
        ax.tick_params(axis="x", labelrotation=90, labelsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def format_summary(summary: dict) -> str:
    lines = [f"{summary['shards']}: grid {summary['grid']}, {summary['router']} router on {summary['features']} features",
             "", "| path | docs | share | train tokens | top labels | top terms / opening |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in summary["paths"]:
        what = ", ".join(r["terms"]) if r["terms"] else (r["openings"][0] if r["openings"] else "")
        what = what.replace("|", "\\|")
        lines.append(f"| {r['path']} | {r['docs']} | {r['share']:.1%} | {r['train_tokens']} | {', '.join(r['labels']) or '-'} | {what} |")
    sizes = summary.get("path_sizes") or {}
    if sizes:
        lines.append(f"\npath sizes: min {sizes['min']}, max {sizes['max']}, mean {sizes['mean']}, "
                     f"max/mean {sizes['max_over_mean']}, cv {sizes['cv']}")
    for r in summary["paths"]:
        for o in r["openings"]:
            lines.append(f"  {r['path']}: {o}")
    if summary.get("png"):
        lines.append(f"\nwrote {summary['png']} (the plot of path sizes)")
    else:
        lines.append("\nno plot written; add --png FILE.png (or a directory) for one")
    return "\n".join(lines)
