"""Per-path early stopping: each path at the checkpointed round of its lowest validation loss, read from the run's
``metrics.jsonl`` (the ``kind="round"`` lines the training engines write)."""

from __future__ import annotations

import json
import math

from dipaco.errors import DipacoError
from dipaco.storage.run import Run


def read_metrics(run: Run) -> list[dict]:
    f = run.root / "metrics.jsonl"
    if not f.is_file():
        return []
    rows = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise DipacoError(f"{f} line {n} is not JSON; repair or remove that line") from None
    return rows


def val_loss_by_round(run: Run) -> dict[int, dict[str, float]]:
    """{round: {path: validation loss of the global weights after that round}} from metrics.jsonl."""
    out = {}
    for row in read_metrics(run):
        if row.get("kind") == "round" and row.get("val_loss"):
            out[int(row["round"])] = {p: float(v) for p, v in row["val_loss"].items()}
    return out


def early_stopping_rounds(run: Run) -> dict[str, int]:
    """Per path, the checkpointed round with the lowest validation loss (ties: the earliest)."""
    available = set(run.rounds)
    picks: dict[str, tuple[float, int]] = {}
    for r, losses in sorted(val_loss_by_round(run).items()):
        if r not in available:
            continue
        for p, loss in losses.items():
            if math.isfinite(loss) and (p not in picks or loss < picks[p][0]):
                picks[p] = (loss, r)
    if not picks:
        raise DipacoError(f"{run.root / 'metrics.jsonl'} has no validation losses for checkpointed rounds; "
                          f"train with val_batches > 0 or drop --early-stopping")
    latest = run.latest()
    return {p: picks[p][1] if p in picks else latest for p in run.grid.paths}
