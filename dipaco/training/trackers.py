"""Trackers (``--log-to tensorboard,wandb``): a run's round records, the ones metrics.jsonl holds, as TensorBoard and
Weights & Biases scalars; ``dipaco eval``'s table and ``dipaco serve``'s throughput go to the same tracker run.

One source: the trackers listen to the round log (``dipaco.training.round_log``) and take the very records it writes
to metrics.jsonl, whatever the engine. Opening the trackers of a run first replays the round records of metrics.jsonl
that a tracker lacks (a resumed run, a tracker added later, a process stopped between the two writes), and a round a
tracker already has is never written again (a resumed run repeats the rounds after its last checkpoint), so every round
is in every tracker once, in order. The step is the round. ``RUN/trackers.json`` keeps, per tracker, the last round it has, and the W&B run id that
every later process reuses.

What each scalar means: docs/training.md (Watching a run).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.io import read_json, write_json
from dipaco.training.tracker_backends import TensorBoardWriter, WandbWriter, require

STATE_FILE = "trackers.json"
NORMS = ("outer_grad_norm", "update_norm", "momentum_norm")


# ------------------------------------------------------------------------------------------------ a round's scalars
def round_scalars(record: dict, trainee_paths: list[str]) -> dict[str, float]:
    """The scalars of one ``kind="round"`` record (``trainee_paths[i]``: trainee i's path); a field the record lacks
    (an engine that does not measure it, a dropped phase) is left out, never written as zero."""
    out = _path_scalars(record, trainee_paths)
    for m, norms in sorted((record.get("module_norms") or {}).items()):
        out |= {f"{name}/{m}": norms[name] for name in NORMS if norms.get(name) is not None}
    for tag, key in (("speed/tokens_per_s", "tokens_per_s"), ("speed/round_s", "seconds"),
                     ("comm/bytes_sent", "bytes_sent"), ("comm/bytes_received", "bytes_received"),
                     ("comm/wait_s", "wait_s"), ("workers/present", "workers"),
                     ("storage/bytes_read", "storage_read"), ("storage/bytes_written", "storage_written")):
        if isinstance(record.get(key), (int, float)):
            out[tag] = float(record[key])
    if record.get("engine") == "ray":
        phases = record.get("phases") or []
        out |= {"phases/retried": float(len(record.get("retried") or [])),
                "phases/dropped": float(len(record.get("dropped") or [])),
                "phases/replayed": float(sum(1 for p in phases if p.get("replayed")))}
    return out


def _path_scalars(record: dict, trainee_paths: list[str]) -> dict[str, float]:
    """Training loss per path (the mean over the path's trainees that reported one) and validation perplexity."""
    out, by_path = {}, {}
    for path, loss in zip(trainee_paths, record.get("train_loss_by_trainee") or []):
        if loss is not None:
            by_path.setdefault(path, []).append(loss)
    for path, losses in sorted(by_path.items()):
        out[f"train_loss/{path}"] = sum(losses) / len(losses)
    if record.get("train_loss") is not None:
        out["train_loss/mean"] = float(record["train_loss"])
    for path, loss in sorted((record.get("val_loss") or {}).items()):
        if loss is not None:
            out[f"val_ppl/{path}"] = math.exp(loss)
    if record.get("val_loss_mean") is not None:
        out["val_ppl/of_mean_loss"] = math.exp(record["val_loss_mean"])
    return out


def round_records(run_dir: Path) -> list[dict]:
    """The ``kind="round"`` records of RUN/metrics.jsonl, one per round (the first of a repeated round), in order."""
    path, rounds = Path(run_dir) / "metrics.jsonl", {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a stopped process
        if isinstance(row, dict) and row.get("kind") == "round":
            rounds.setdefault(int(row["round"]), row)
    return [rounds[r] for r in sorted(rounds)]


# ------------------------------------------------------------------------------------------------ the trackers
class Trackers:
    """The trackers of one run directory, named by ``log.to``; ``open`` returns None when it names none."""

    def __init__(self, run_dir: Path, writers: dict, state: dict, trainee_paths: list[str]):
        self.run_dir, self.writers, self.state, self.trainee_paths = run_dir, writers, state, trainee_paths

    @classmethod
    def open(cls, run_dir: str | Path, log, catch_up: bool = True) -> Trackers | None:
        """The trackers ``log`` (a ``LogConfig``) names for the run ``run_dir`` (its run.json written), with the rounds
        of its metrics.jsonl they lack written first (``catch_up``)."""
        names = log.trackers
        if not names:
            return None
        require(names)
        run_dir = Path(run_dir)
        info = read_json(run_dir / "run.json", "run description")
        state = read_json(run_dir / STATE_FILE, "tracker state") if (run_dir / STATE_FILE).is_file() else {}
        writers = {}
        try:
            for name in names:
                state.setdefault(name, {"round": 0})
                writers[name] = _writer(name, run_dir, log, state[name])
        except DipacoError:
            for w in writers.values():
                w.close()
            raise
        trackers = cls(run_dir, writers, state, [t["path"] for t in info["trainees"]])
        trackers.keep({name: dict(state[name]) for name in names})  # the W&B id is kept before anything is logged under it
        if catch_up:
            for record in round_records(run_dir):
                trackers.round(record)
        return trackers

    def __call__(self, record: dict) -> None:
        """A listener of the round log (``dipaco.training.round_log.RoundLog``): it hands over every record it writes
        to metrics.jsonl; the trackers take the round lines."""
        if record.get("kind") == "round":
            self.round(record)

    def round(self, record: dict) -> None:
        """Write round ``record["round"]`` to every tracker that does not have it yet."""
        r = int(record["round"])
        behind = [name for name in self.writers if self.state[name]["round"] < r]
        if not behind:
            return
        values = round_scalars(record, self.trainee_paths)
        for name in behind:
            self.writers[name].scalars(values, r)
        self.keep({name: {"round": r} for name in behind})

    def table(self, tag: str, columns: list[str], rows: list[list], scalars: dict[str, float], step: int) -> None:
        """A table and its scalars at ``step`` (``dipaco eval``: the evaluated round)."""
        for w in self.writers.values():
            w.table(tag, columns, rows, step)
            w.scalars(scalars, step)

    def series(self, values: dict[str, float], axis: str) -> None:
        """Scalars against an axis of their own (``dipaco serve``: seconds since it started)."""
        for w in self.writers.values():
            w.series(values, axis)

    def note(self, key: str, value) -> None:
        """Keep ``key`` in the entry of every tracker this process writes to (``dipaco serve``: its seconds)."""
        self.keep({name: {key: value} for name in self.writers})

    def keep(self, updates: dict[str, dict]) -> None:
        """RUN/trackers.json as it is on disk now with ``updates`` ({tracker: {key: value}}) applied: a server
        notes its seconds while a training may be writing its rounds, and neither undoes the other's."""
        path = self.run_dir / STATE_FILE
        state = read_json(path, "tracker state") if path.is_file() else {}
        for name, values in updates.items():
            state.setdefault(name, {"round": 0}).update(values)
            self.state.setdefault(name, {"round": 0}).update(values)
        write_json(path, state)

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def _writer(name: str, run_dir: Path, log, state: dict):
    if name == "tensorboard":
        return TensorBoardWriter(run_dir / "tensorboard")
    state.setdefault("wandb_id", uuid.uuid4().hex[:8])
    config_file = run_dir / "config.toml"
    config = _toml(config_file) if config_file.is_file() else None
    return WandbWriter(run_dir, log.wandb_project, state["wandb_id"], run_dir.name, config)


def _toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------------ dipaco eval
EVAL_COLUMNS = ["method", "perplexity", "scored tokens", "documents", "round", "routing"]


def log_eval_report(report: dict, log) -> list[str]:
    """``dipaco eval``'s report to the trackers of every run it scored (a baseline's too): each run gets the table of
    its own rows and their perplexities (overall and per label) at the round they scored (none: nothing). Returns the
    runs logged to."""
    if not log.trackers:
        return []
    by_run: dict[str, list[tuple[str, dict]]] = {}
    for name, row in report["methods"].items():
        by_run.setdefault(row["run"], []).append((name, row))
    for run_dir, rows in by_run.items():
        trackers = Trackers.open(run_dir, log, catch_up=False)
        step = max((row.get("round") or 0 for _, row in rows), default=0) or max(s["round"] for s in trackers.state.values())
        table = [[name, row["perplexity"], row["tokens"], row["documents"], str(row.get("round") or "per path"),
                  row.get("routing", "")] for name, row in rows]
        scalars = {}
        for name, row in rows:
            tag = "eval_ppl/" + name.replace(" ", "_")
            scalars[tag] = float(row["perplexity"])
            for label, cell in sorted(row.get("per_label", {}).items()):
                if cell.get("perplexity") is not None:
                    scalars[f"{tag}/{label}"] = float(cell["perplexity"])
        trackers.table("eval/report", EVAL_COLUMNS, table, scalars, step)
        trackers.close()
    return list(by_run)
