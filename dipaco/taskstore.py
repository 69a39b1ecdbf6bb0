"""The task queue's shared storage: where every phase's output and every module version lives in the run directory.

The Ray engine (``dipaco.ray_engine``) keeps no state of its own: the run directory is the source of truth, so a
driver, a worker or a whole cluster can die and a new driver rebuilds the queue from what is committed here.

    RUN/queue/phases/<v>/trainee_<i>/     phase (i, v): trainee i's H inner steps from module version v
        deltas.safetensors                  its outer gradient per module, as sent (fp32, or the comm.bits payload)
        state.pt                            its trainee state after the phase (AdamW, step, data cursor)
        phase.json                          losses, timings, where it ran
    RUN/queue/attempts/<v>/trainee_<i>/<id>.json   one per attempt started (node, pid): retries are counted here
    RUN/queue/attempts/<v>/step_<group>/<id>.json  the same for the outer step from version v
    RUN/queue/dropped/<v>/trainee_<i>     the driver dropped phase (i, v) (quorum); its result is never used
    RUN/queue/versions/<v>/<group>/       an outer step's output: version v of the group's modules
        <module>.safetensors, outer.safetensors (momentum, "module/name" keys), step.json
    RUN/queue/val/<v>/<path>.json         validation loss of the path's global weights at version v

A phase or an outer step writes into a hidden temporary directory and commits by renaming it into place; the first
rename wins (a directory is never renamed over a non-empty one), so a retried or duplicated task overwrites nothing
a finished one wrote. Version v of a module is read from ``queue/versions`` or, when round v is a checkpoint, from
``checkpoints/round_<v>``; ``assemble`` turns a finished round into the same checkpoint the sync engine writes, so
eval, generate, export, reshard and ``--resume`` read a Ray run like any other.

A *group* is the set of modules averaged over the same trainees (``groups``): one outer-step task each per round.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dipaco import checkpoint
from dipaco.io import atomic_write_text, read_json


def groups(weights: dict[str, dict[int, float]]) -> dict[str, list[str]]:
    """{group name: modules} for modules averaged over the same trainees (``Plan.weights``), in module order."""
    by_trainees: dict[tuple[int, ...], list[str]] = {}
    for m, ws in weights.items():
        by_trainees.setdefault(tuple(sorted(ws)), []).append(m)
    return {"+".join(ms) if len(ms) <= 4 else f"{ms[0]}+{len(ms) - 1}": ms for ms in by_trainees.values()}


class TaskStore:
    def __init__(self, run: str | Path):
        self.run = Path(run)
        self.root = self.run / "queue"

    # ------------------------------------------------------------------------------------------- names
    def phase_dir(self, v: int, i: int) -> Path:
        return self.root / "phases" / str(v) / f"trainee_{i}"

    def attempts_dir(self, v: int, who: int | str) -> Path:
        """Attempts of phase (``who`` = trainee, v), or of an outer step from v (``who`` = "step_<group>")."""
        return self.root / "attempts" / str(v) / (f"trainee_{who}" if isinstance(who, int) else who)

    def dropped_file(self, v: int, i: int) -> Path:
        return self.root / "dropped" / str(v) / f"trainee_{i}"

    def version_dir(self, v: int, group: str) -> Path:
        return self.root / "versions" / str(v) / group

    def val_file(self, v: int, path: str) -> Path:
        return self.root / "val" / str(v) / f"{path}.json"

    # ------------------------------------------------------------------------------------------- state
    def committed(self, v: int, i: int) -> bool:
        return (self.phase_dir(v, i) / "phase.json").is_file()

    def dropped(self, v: int, i: int) -> bool:
        return self.dropped_file(v, i).is_file()

    def version_ready(self, v: int, group: str) -> bool:
        return (self.version_dir(v, group) / "step.json").is_file()

    def phase_info(self, v: int, i: int) -> dict:
        return read_json(self.phase_dir(v, i) / "phase.json", "phase record")

    def step_info(self, v: int, group: str) -> dict:
        return read_json(self.version_dir(v, group) / "step.json", "outer step record")

    def attempts(self, v: int, who: int | str) -> list[dict]:
        d = self.attempts_dir(v, who)
        return sorted((json.loads(f.read_text()) for f in d.glob("*.json")), key=lambda a: a["started"]) if d.is_dir() else []

    def step_attempts(self, v: int) -> int:
        """Attempts of outer steps from version v, over all groups."""
        return len(list((self.root / "attempts" / str(v)).glob("step_*/*.json")))

    def val_loss(self, v: int, path: str) -> float | None:
        f = self.val_file(v, path)
        return float(json.loads(f.read_text())["loss"]) if f.is_file() else None

    # ------------------------------------------------------------------------------------------- writing
    def record_attempt(self, v: int, who: int | str, where: dict) -> int:
        """Note an attempt (see ``attempts_dir``) as started; returns its number (1 for the first)."""
        d = self.attempts_dir(v, who)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / f"{uuid.uuid4().hex}.json", json.dumps(where))
        return len(list(d.glob("*.json")))

    def drop(self, v: int, i: int, why: str) -> None:
        f = self.dropped_file(v, i)
        f.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f, why + "\n")

    def write_val(self, v: int, path: str, loss: float) -> None:
        f = self.val_file(v, path)
        f.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f, json.dumps({"loss": loss}))

    def staging(self, final: Path) -> Path:
        """A fresh hidden directory beside ``final`` for one attempt to write into."""
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return tmp

    @staticmethod
    def commit(tmp: Path, final: Path) -> bool:
        """Rename ``tmp`` to ``final``; False (and ``tmp`` removed) when another attempt committed first."""
        try:
            os.rename(tmp, final)
            return True
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False

    # ------------------------------------------------------------------------------------------- reading
    def module_file(self, m: str, group: str, v: int) -> Path:
        """Where version v of module m is: the outer step's output, else round v's checkpoint."""
        f = self.version_dir(v, group) / f"{m}.safetensors"
        return f if f.is_file() else checkpoint.round_dir(self.run, v) / "modules" / f"{m}.safetensors"

    def outer_file(self, group: str, v: int) -> Path:
        f = self.version_dir(v, group) / "outer.safetensors"
        return f if f.is_file() else checkpoint.round_dir(self.run, v) / "state" / "outer.safetensors"

    def state_source(self, i: int, v: int, checkpoints: set[int]) -> tuple[Path, bool]:
        """(file, is_exact) of trainee i's state at version v: the committed phase (i, v-1), or round v's checkpoint.
        After a dropped phase it is the state from before that phase (not exact: its step is moved to the round's)."""
        u = v
        while True:
            if u in checkpoints:
                return checkpoint.round_dir(self.run, u) / "state" / f"trainee_{i}.pt", u == v
            if not self.dropped(u - 1, i):
                return self.phase_dir(u - 1, i) / "state.pt", u == v
            u -= 1

    # ------------------------------------------------------------------------------------------- checkpoints
    def assemble(self, v: int, group_of: dict[str, str], trainee_paths: list[str], H: int, checkpoints: set[int]) -> None:
        """Write round v's checkpoint (the sync engine's format) from the queue: module files and trainee states are
        hard-linked (copied across file systems), the groups' momentum joined into one file; ``latest`` moves last."""
        tmp = checkpoint.begin_round(self.run, v)
        try:
            for m, g in group_of.items():
                _link(self.module_file(m, g, v), tmp / "modules" / f"{m}.safetensors")
            for i in range(len(trainee_paths)):
                source, exact = self.state_source(i, v, checkpoints)
                if exact:
                    _link(source, tmp / "state" / f"trainee_{i}.pt")
                else:  # its last phase was dropped: the state before it, at this round's step
                    state = torch.load(source, map_location="cpu", weights_only=True)
                    state["step"] = v * H
                    torch.save(state, tmp / "state" / f"trainee_{i}.pt")
            outer = {}
            for g in dict.fromkeys(group_of.values()):
                outer.update(load_file(str(self.outer_file(g, v))))
            checkpoint.finish_round(self.run, v, tmp, list(group_of), outer, len(trainee_paths),
                                    {"trainee_paths": trainee_paths, "engine": "ray"})
        except BaseException:
            checkpoint.abort_round(tmp)
            raise

    def forget_before(self, v: int) -> None:
        """Remove what no task can read any more: phases, attempts, drops and validation of versions below v and the
        module versions below v (a later checkpoint holds what is still needed)."""
        for kind in ("phases", "attempts", "dropped", "versions", "val"):
            folder = self.root / kind
            for d in folder.iterdir() if folder.is_dir() else ():
                if d.name.isdigit() and int(d.name) < v:
                    shutil.rmtree(d, ignore_errors=True)

    def remove_staging(self) -> None:
        """Temporary directories of attempts that never committed (a new driver starts; the old tasks are gone)."""
        for kind in ("phases", "versions"):
            for d in (self.root / kind).glob("*/.*.tmp-*"):
                shutil.rmtree(d, ignore_errors=True)


def save_tensors(tensors: dict[str, torch.Tensor], f: Path) -> int:
    """safetensors file of CPU tensors; returns its payload bytes (what crossed to storage)."""
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(f))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(source, target)
