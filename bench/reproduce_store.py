"""Durable results of bench/reproduce.py: one small JSON per finished job, committed in the repository, so a later
session re-trains only what is missing (run directories under --out do not survive a session; these files do).

A job's file is ``<results>/<corpus>/<job>.json``: its fingerprint, the settings it ran with and what it measured
(round metrics, evaluation summaries, parameter counts). The fingerprint hashes everything that decides the
numbers: the job's command line (paths relative to --out), its evaluations, the scale, the corpus, PROTOCOL, and
the fingerprints of the jobs whose results it used. A file whose fingerprint does not match is ignored (and
replaced when the job runs again).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

# Bump when a change of the benchmark or of dipaco changes what a job measures: every durable result is then stale.
PROTOCOL = 3

# How a job calls dipaco; hashed as one word, so moving the CLI's module does not make every result stale.
CLI = [sys.executable, "-m", "dipaco.cli"]


def fingerprint(spec: dict, out: Path, deps: dict[str, str]) -> str:
    """sha256 (16 hex digits) of a job's spec with --out written as OUT, and its dependencies' fingerprints."""
    text = json.dumps({"spec": spec, "deps": dict(sorted(deps.items())), "protocol": PROTOCOL}, sort_keys=True)
    text = text.replace(json.dumps(CLI)[1:-1], '"DIPACO"')
    text = text.replace(str(out), "OUT").replace(sys.executable, "PYTHON")  # where it ran says nothing
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def job_file(results: Path, corpus: str, job: str) -> Path:
    return results / corpus / f"{job}.json"


def load(results: Path, corpus: str, job: str, fp: str | None = None) -> dict | None:
    """A job's durable result; None when absent, unreadable, or (with ``fp``) of another fingerprint."""
    f = job_file(results, corpus, job)
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or (fp is not None and data.get("fingerprint") != fp):
        return None
    return data


def save(results: Path, corpus: str, job: str, data: dict) -> Path:
    """Written under a temporary name and renamed, so a killed job leaves no half file."""
    f = job_file(results, corpus, job)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(data), indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    os.replace(tmp, f)
    return f


def load_all(results: Path, corpus: str) -> dict[str, dict]:
    """Every durable result of a corpus by job name (fingerprints are checked by the planner, not here)."""
    folder = results / corpus
    out = {}
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        data = load(results, corpus, f.stem)
        if data is not None:
            out[f.stem] = data
    return out


def method(result: dict | None, key: str, name: str) -> dict:
    """One method of one evaluation (``key``) of a durable result, as ``compact_report`` kept it; {} where absent."""
    return ((result or {}).get("evals", {}).get(key) or {}).get("methods", {}).get(name) or {}


def compact_report(report: dict) -> dict:
    """What the page needs of an evaluation report: per method its perplexity, tokens, routing, rule and per-label
    perplexities (the per-path split and raw sums stay in the run directory)."""
    methods = {}
    for name, m in report["methods"].items():
        row = {k: m.get(k) for k in ("perplexity", "tokens", "documents", "routing", "round", "rounds") if k in m}
        if m.get("per_label"):
            row["per_label"] = {k: v["perplexity"] for k, v in m["per_label"].items()}
        for key in ("policy", "once_policy"):
            if m.get(key):
                p = m[key]
                row[key] = {k: p.get(k) for k in ("name", "reason", "chosen", "scores", "router_documents") if k in p}
                if p.get("one_path"):
                    row[key]["one_path"] = {k: p["one_path"].get(k) for k in ("name", "reason", "chosen")}
        if row.get("policy"):  # model forward passes per scored token, relative to routing once
            row["forward_passes"] = _forward_passes(row["policy"]["chosen"], m.get("grid"))
            if row["policy"].get("one_path"):
                row["policy"]["one_path"]["forward_passes"] = _forward_passes(row["policy"]["one_path"]["chosen"], m.get("grid"))
        methods[name] = row
    return {"split": report.get("split"), "documents": report.get("documents"), "methods": methods}


def _forward_passes(chosen: dict, grid: str | None) -> int | None:
    from dipaco.eval.window_policy import rule_of

    if not grid:
        return None
    return rule_of(chosen).forward_passes(math.prod(int(k) for k in str(grid).split("x")))


def _finite(x):
    """NaN and infinity become null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
