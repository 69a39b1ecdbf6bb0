"""Run-directory checkpoints: one safetensors file per module, optimizer and data state, ``latest``.

    RUN/checkpoints/round_<r>/modules/<module-id>.safetensors   a shared module is stored once
    RUN/checkpoints/round_<r>/state/outer.safetensors           outer momentum buffers
    RUN/checkpoints/round_<r>/state/trainee_<i>.pt              AdamW state, step, data cursor
    RUN/checkpoints/round_<r>/state/sync.pt                     streamed reductions still due (streaming only)
    RUN/checkpoints/round_<r>/state/meta.json                   round, module list, trainee paths
    RUN/checkpoints/latest                                      "round_<r>", moved after the round is whole

Round 0 holds the initial weights. A round directory is written under a temporary name and renamed
into place, so a crash leaves the previous complete round intact. Loading uses safetensors, JSON and
``torch.load(weights_only=True)`` only: nothing is unpickled.

Several workers write one round together (``Checkpointer.save``, the distributed commit):
``begin_round`` (rank 0) makes the temporary directory, every worker writes its ``Part`` (its modules and
trainee states) into it (``write_modules``, ``write_trainees``), and ``finish_round`` (rank 0, after every
worker is done) adds the outer state, the streamed reductions and ``meta.json``, checks that every module
and trainee file is there, renames the directory into place and only then moves ``latest``. A failure on
any worker is passed to all of them (none hangs) and leaves ``latest`` where it was. ``save_round`` does
all of it in one process.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dipaco.errors import DipacoError
from dipaco.io import atomic_write_text, commit_dir, read_json, write_json

if TYPE_CHECKING:
    from dipaco.training.comm import World


def round_dir(run: str | Path, r: int) -> Path:
    return Path(run) / "checkpoints" / f"round_{r}"


def save_round(run: str | Path, r: int, modules: dict[str, dict[str, torch.Tensor]], outer_state: dict[str, torch.Tensor],
               trainee_states: list[dict], meta: dict, sync_state: list | None = None) -> Path:
    tmp = begin_round(run, r)
    try:
        write_modules(tmp, modules)
        write_trainees(tmp, dict(enumerate(trainee_states)))
        return finish_round(run, r, tmp, list(modules), outer_state, len(trainee_states), meta, sync_state)
    except BaseException:
        abort_round(tmp)
        raise


def begin_round(run: str | Path, r: int) -> Path:
    """Create (afresh) the temporary directory of round ``r``; return it."""
    final = round_dir(run, r)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "modules").mkdir(parents=True)
    (tmp / "state").mkdir()
    return tmp


def write_modules(tmp: Path, modules: dict[str, dict[str, torch.Tensor]]) -> None:
    for m, tensors in modules.items():
        save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(tmp / "modules" / f"{m}.safetensors"))


def write_trainees(tmp: Path, states: dict[int, dict]) -> None:
    for i, state in states.items():
        torch.save(state, tmp / "state" / f"trainee_{i}.pt")


def finish_round(run: str | Path, r: int, tmp: Path, modules: list[str], outer_state: dict[str, torch.Tensor],
                 num_trainees: int, meta: dict, sync_state: list | None = None) -> Path:
    """Complete a round whose module and trainee files are written; rename it into place, move ``latest``."""
    missing = [f"modules/{m}.safetensors" for m in modules if not (tmp / "modules" / f"{m}.safetensors").is_file()]
    missing += [f"state/trainee_{i}.pt" for i in range(num_trainees) if not (tmp / "state" / f"trainee_{i}.pt").is_file()]
    if missing:
        raise DipacoError(f"checkpoint {tmp} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} after every "
                          f"worker wrote its part; with workers on several machines the run directory must be shared")
    save_file({k: v.detach().cpu().contiguous() for k, v in outer_state.items()}, str(tmp / "state" / "outer.safetensors"))
    if sync_state:
        torch.save(sync_state, tmp / "state" / "sync.pt")
    write_json(tmp / "state" / "meta.json", {"round": r, "modules": list(modules), **meta})
    final = round_dir(run, r)
    commit_dir(tmp, final)
    atomic_write_text(Path(run) / "checkpoints" / "latest", f"round_{r}\n")
    return final


def abort_round(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def remove_partial_rounds(run: str | Path) -> list[str]:
    """Delete round directories a crash left half-written (hidden temporary names); return their names."""
    root = Path(run) / "checkpoints"
    stale = [p for p in root.glob(".round_*.tmp-*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def list_rounds(run: str | Path) -> list[int]:
    root = Path(run) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name.split("_", 1)[1]) for p in root.glob("round_*")
                  if p.is_dir() and p.name.split("_", 1)[1].isdigit())


def latest_round(run: str | Path) -> int | None:
    """The round ``latest`` names; without ``latest`` (removed, or lost before it was first written) the highest
    complete round, so that resuming never starts over a run that has rounds."""
    pointer = Path(run) / "checkpoints" / "latest"
    complete = [r for r in list_rounds(run) if (round_dir(run, r) / "state" / "meta.json").is_file()]
    if not pointer.is_file():
        return max(complete) if complete else None
    name = pointer.read_text(errors="replace").strip()
    if not name.startswith("round_") or not name[6:].isdigit() or not round_dir(run, int(name[6:])).is_dir():
        fix = (f"write round_{max(complete)} (its highest complete round) into it to resume from there" if complete
               else "no complete round is left: train into a new --out")
        raise DipacoError(f"{pointer} names {name[:40]!r}, which is not a complete checkpoint; {fix}")
    return int(name[6:])


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise DipacoError(f"checkpoint file {path} is missing; the checkpoint is incomplete, resume from an earlier round")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DipacoError(f"checkpoint file {path} is corrupt or truncated ({exc}); "
                          f"restore it or resume from an earlier round") from None


def load_modules(run: str | Path, r: int, names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Load the named modules (all of the round's modules by default) of round ``r``."""
    meta = read_json(round_dir(run, r) / "state" / "meta.json", "checkpoint metadata")
    wanted = meta["modules"] if names is None else names
    return {m: load_tensors(round_dir(run, r) / "modules" / f"{m}.safetensors") for m in wanted}


def load_state(run: str | Path, r: int, indices: list[int] | None = None) -> tuple[dict[str, torch.Tensor], list[dict], dict]:
    """Outer buffers, the states of the trainees ``indices`` (all by default), and the metadata."""
    base = round_dir(run, r) / "state"
    meta = read_json(base / "meta.json", "checkpoint metadata")
    outer = load_tensors(base / "outer.safetensors")
    trainees = []
    for i in range(len(meta["trainee_paths"])) if indices is None else indices:
        f = base / f"trainee_{i}.pt"
        try:
            trainees.append(torch.load(f, map_location="cpu", weights_only=True))
        except FileNotFoundError:
            raise DipacoError(f"checkpoint file {f} is missing; resume from an earlier round") from None
        except Exception as exc:  # torch raises several types for a damaged file
            raise DipacoError(f"checkpoint file {f} is corrupt ({type(exc).__name__}); resume from an earlier round") from None
    return outer, trainees, meta


def load_sync(run: str | Path, r: int) -> list:
    """Streamed reductions saved with round ``r`` (empty for plain rounds)."""
    f = round_dir(run, r) / "state" / "sync.pt"
    if not f.is_file():
        return []
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise DipacoError(f"checkpoint file {f} is corrupt ({type(exc).__name__}); resume from an earlier round") from None


# ------------------------------------------------------------------------------ the distributed commit
@dataclass
class Part:
    """One worker's share of a round, written or read back: the modules it is the lowest-rank holder of
    (all the modules it holds, when read back), its trainees' states, the outer buffers of those modules
    (``"module/name"`` keys) and the reductions in flight (``ModuleSync.state``) with their grads of those modules."""
    modules: dict[str, dict[str, torch.Tensor]]
    trainees: dict[int, dict]
    outer: dict[str, torch.Tensor]
    sync: list[dict]


class Checkpointer:
    """Commits a round that every worker writes a part of, and reads a worker's part back. ``modules``: every
    module of the run, ``trainee_paths``: every trainee's path (both for ``meta.json`` and the completeness check)."""

    def __init__(self, run: str | Path, world: World, modules: list[str], trainee_paths: list[str]):
        self.run, self.world, self.modules, self.trainee_paths = Path(run), world, modules, trainee_paths

    def save(self, r: int, part: Part) -> None:
        """Every worker writes its part straight into the round's temporary directory (made by rank 0); rank 0
        gathers the small rest (outer buffers, streamed reductions), completes the round and moves ``latest``;
        every rank learns whether that worked (a DipacoError on all of them if not)."""
        world = self.world
        tmp = world.broadcast(_attempt(lambda: str(begin_round(self.run, r))) if world.rank == 0 else None)
        error = tmp if isinstance(tmp, DipacoError) else _attempt(lambda: self._write(Path(tmp), part), world.rank)
        parts = world.gather({"error": error, "outer": part.outer, "sync": part.sync})
        outcome = None
        if world.rank == 0:
            outcome = next((p["error"] for p in parts if isinstance(p["error"], DipacoError)), None)
            if outcome is None:
                outcome = _attempt(lambda: self._finish(r, Path(tmp), parts))
            if isinstance(outcome, DipacoError) and not isinstance(tmp, DipacoError):
                abort_round(Path(tmp))
        outcome = world.broadcast(outcome)
        if isinstance(outcome, DipacoError):
            raise DipacoError(str(outcome))

    def load(self, r: int, modules: list[str], trainees: list[int]) -> Part:
        """The part of a worker that holds ``modules`` and trains ``trainees``, from round ``r`` (on the CPU)."""
        tensors = load_modules(self.run, r, modules)
        outer, states, _ = load_state(self.run, r, trainees)
        return Part(tensors, dict(zip(trainees, states)),
                    {k: v for k, v in outer.items() if k.split("/", 1)[0] in modules}, load_sync(self.run, r))

    @staticmethod
    def _write(tmp: Path, part: Part) -> None:
        write_modules(tmp, part.modules)
        write_trainees(tmp, part.trainees)

    def _finish(self, r: int, tmp: Path, parts: list[dict]) -> None:
        outer_state = {k: v for p in parts for k, v in p["outer"].items()}
        pending = {}  # a reduction's grads come in pieces, one per module owner: join them
        for p in parts:
            for d in p["sync"]:
                pending.setdefault((d["started"], d["fragment"]), {**d, "grads": {}})["grads"].update(d["grads"])
        finish_round(self.run, r, tmp, self.modules, outer_state, len(self.trainee_paths),
                     {"trainee_paths": self.trainee_paths}, [pending[k] for k in sorted(pending)])


def _attempt(fn, rank: int = 0):
    """fn()'s result, or its exception as a DipacoError (to pass to the other ranks instead of hanging them)."""
    try:
        return fn()
    except DipacoError as exc:
        return exc
    except Exception as exc:
        return DipacoError(f"writing the checkpoint failed on worker {rank}: {type(exc).__name__}: {exc}")
