"""The scorer every eval method shares: the per-target loss of documents under (path, round), each model window
computed once, and the summary of a method's segments.

A *method* gives every document a list of segments ``(lo, hi, [(path, round, weight), ...])``: the targets at
positions [lo, hi) are scored by that path (weight 1) or by a mixture of paths (next-token probabilities of the true
token weighted). All methods of one run share a ``Scorer``, so oracle, random, every-W and mixture rows reuse the
forward passes of the routed row, and choosing a routing rule on the router documents reuses them too.
"""

from __future__ import annotations

import math

import numpy as np
from tqdm.auto import tqdm

from dipaco.model.scoring import window_nll, windows_for
from dipaco.storage.run import Run

Segment = tuple[int, int, list[tuple[str, int, float]]]


class Scorer:
    """Per-target NLL of the documents ``ids`` under (path, round), each window computed once."""

    def __init__(self, run: Run, ids: list[list[int]], batch_size: int, progress: bool = True):
        self.run, self.ids, self.batch_size, self.progress = run, ids, batch_size, progress
        self.seq_len = run.config.model.max_seq_len
        self.cache: dict[tuple[str, int], dict[tuple[int, int], np.ndarray]] = {}

    def missing(self, segments: list[list[Segment]]) -> dict[tuple[str, int], list[tuple[int, int]]]:
        """{(path, round): [(document, window), ...]} that the segments need and the cache lacks."""
        need: dict[tuple[str, int], set[tuple[int, int]]] = {}
        for d, segs in enumerate(segments):
            for lo, hi, mix in segs:
                for path, r, _ in mix:
                    need.setdefault((path, r), set()).update((d, j) for j in windows_for(lo, hi, self.seq_len))
        todo = {key: sorted(need[key] - self.cache.get(key, {}).keys()) for key in sorted(need)}
        return {key: windows for key, windows in todo.items() if windows}

    def ensure(self, segments: list[list[Segment]]) -> None:
        """Compute every window any segment needs, loading each path model once."""
        for key, todo in self.missing(segments).items():
            have = self.cache.setdefault(key, {})
            model = self.run.path_model(*key).model  # only this path's modules are loaded
            with tqdm(total=len(todo), desc=f"{self.run.root.name} path {key[0]} round {key[1]}", unit="win",
                      disable=not self.progress, dynamic_ncols=True, leave=False) as bar:
                have.update(window_nll(model, self.ids, todo, self.seq_len, self.batch_size,
                                       pad_id=self.run.info["eos_token_id"], progress=bar))

    def nll(self, path: str, r: int, d: int, lo: int, hi: int) -> np.ndarray:
        """NLL of targets [lo, hi) of document d (their windows must have been ensured)."""
        parts, windows = [], self.cache[(path, r)]
        for j in windows_for(lo, hi, self.seq_len):
            first = j * self.seq_len + 1
            parts.append(windows[(d, j)][max(0, lo - first):hi - first])
        return np.concatenate(parts) if parts else np.zeros(0)

    def score(self, segments: list[list[Segment]]) -> tuple[list[tuple[float, int]], dict[str, list]]:
        """Per document (NLL sum, tokens) and per top path [NLL sum, tokens, documents]."""
        self.ensure(segments)
        per_doc, per_path = [], {}
        for d, segs in enumerate(segments):
            total, count, seen = 0.0, 0, set()
            for lo, hi, mix in segs:
                if hi <= lo:
                    continue
                if len(mix) == 1:
                    nll = self.nll(mix[0][0], mix[0][1], d, lo, hi)
                else:  # -log sum_k w_k p_k(x_t), in log space
                    stack = np.stack([math.log(w) - self.nll(p, r, d, lo, hi) for p, r, w in mix if w > 0])
                    top = stack.max(axis=0)
                    nll = -(top + np.log(np.exp(stack - top).sum(axis=0)))
                s = float(nll.sum(dtype=np.float64))
                total, count = total + s, count + len(nll)
                top_path = max(mix, key=lambda m: m[2])[0]
                row = per_path.setdefault(top_path, [0.0, 0, 0])
                row[0], row[1] = row[0] + s, row[1] + len(nll)
                if top_path not in seen:
                    row[2], seen = row[2] + 1, seen | {top_path}
            per_doc.append((total, count))
        return per_doc, per_path


def _ppl(nll: float, n: int) -> float | None:
    return math.exp(nll / n) if n else None


def summarise(per_doc: list[tuple[float, int]], per_path: dict[str, list], labels: list[str | None]) -> dict:
    nll, n = sum(s for s, _ in per_doc), sum(c for _, c in per_doc)
    out = {"perplexity": _ppl(nll, n), "tokens": n, "documents": sum(1 for _, c in per_doc if c), "nll_sum": nll}
    out["per_path"] = {p: {"perplexity": _ppl(v[0], v[1]), "tokens": v[1], "documents": v[2]}
                       for p, v in sorted(per_path.items())}
    if any(l is not None for l in labels):
        out["per_label"] = {}
        for label in sorted({str(l) for l in labels if l is not None}):
            rows = [s for s, l in zip(per_doc, labels) if l is not None and str(l) == label]
            ln, lc = sum(s for s, _ in rows), sum(c for _, c in rows)
            out["per_label"][label] = {"perplexity": _ppl(ln, lc), "tokens": lc, "documents": sum(1 for _, c in rows if c)}
    return out


def once_segments(routes: list[str], ids: list[list[int]], context: int, rounds: dict[str, int] | int) -> list[list[Segment]]:
    lo = max(1, context)
    return [[(lo, len(x), [(p, rounds if isinstance(rounds, int) else rounds[p], 1.0)])] for p, x in zip(routes, ids)]


def segments_of(cuts: list[list[tuple[int, int]]], choice: list[list[str]], r: int) -> list[list[Segment]]:
    return [[(lo, hi, [(p, r, 1.0)]) for (lo, hi), p in zip(cs, ps)] for cs, ps in zip(cuts, choice)]
