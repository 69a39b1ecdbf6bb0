"""The task queue's storage: where every phase's output and every module version lives, on a local disk or in a bucket.

The Ray engine (``dipaco.taskqueue.ray_engine``) keeps no state of its own: storage is the source of truth, so a driver, a
worker or a whole cluster can die and a new driver rebuilds the queue from what is committed here.

    RUN/queue/lineage.json                     which queue belongs to which checkpoint and config (below)
    RUN/queue/<lineage>/phases/<v>/trainee_<i>/
        <attempt>/deltas.safetensors             its outer gradient per module, as sent (fp32, or the comm.bits payload)
        <attempt>/state.pt                       its trainee state after the phase (AdamW, step, data cursor)
        commit.json                              the commit record: which attempt won, its objects' sha256, its record
    RUN/queue/<lineage>/versions/<v>/<group>/    an outer step's output: version v of the group's modules
        <attempt>/<module>.safetensors, <attempt>/outer.safetensors (momentum, "module/name" keys); commit.json
    RUN/queue/<lineage>/val/<v>/<path>.json      validation loss of the path's global weights at version v
    RUN/queue/<lineage>/attempts/<v>/<who>/<id>.json   one per attempt started (node, pid): retries are counted here
    RUN/queue/<lineage>/dropped/<v>/trainee_<i>  the driver dropped phase (i, v) (quorum); its result is never used

**Commits need no rename.** An attempt writes its objects under its own name, then creates the commit record only if
none exists (``Storage.create_if_absent``: S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, a hard link
locally). The first attempt to commit wins; a loser's objects are never read, since readers follow commit records
only, and check every object against the sha256 in the record. A record that does not parse or whose objects fail
their checksum is not a commit: the driver removes it when it starts, and the task is done again (``scan``).

**Checkpoints win over the queue.** Version v of a module is read from ``checkpoints/round_<v>`` when that round is a
checkpoint, and from the queue only otherwise. A queue is only used with the checkpoint it grew from: the lineage
names its base round, a digest of the config that decides its bits, and every round assembled from it records the
lineage; a driver that starts from a checkpoint the queue did not grow from (another engine finished a round, the
config changed) starts a new lineage, and the old one is deleted unread.

``assemble`` turns a finished round into the checkpoint every engine reads (links or copies of the committed objects),
so eval, generate, export, reshard and ``--resume`` read a Ray run like any other.
A *group* is the set of modules averaged over the same trainees (``groups``): one outer-step task each per round.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dipaco.errors import DipacoError
from dipaco.storage.objects import Storage, sha256


def groups(weights: dict[str, dict[int, float]]) -> dict[str, list[str]]:
    """{group name: modules} for modules averaged over the same trainees (``Plan.weights``), in module order."""
    by_trainees: dict[tuple[int, ...], list[str]] = {}
    for m, ws in weights.items():
        by_trainees.setdefault(tuple(sorted(ws)), []).append(m)
    return {"+".join(ms) if len(ms) <= 4 else f"{ms[0]}+{len(ms) - 1}": ms for ms in by_trainees.values()}


class Damaged(Exception):
    """An object that fails its commit record's checksum, or a record that does not parse."""


def ref(key: str, digest: str = "") -> dict:
    """A reference to an object a task reads: its key and, for a queue object, the sha256 its commit record holds."""
    return {"key": key, "sha256": digest}


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({k: t.detach().cpu().contiguous() for k, t in tensors.items()})


def state_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


class TaskStore:
    """The queue of lineage ``lineage`` in the run at ``run`` (a local path or a URL)."""

    def __init__(self, run: str, lineage: str = ""):
        self.run, self.lineage = str(run), lineage
        self.storage = Storage(run)
        self.root = f"queue/{lineage}"

    # ------------------------------------------------------------------------------------------- names
    def phase_key(self, v: int, i: int) -> str:
        return f"{self.root}/phases/{v}/trainee_{i}"

    def version_key(self, v: int, group: str) -> str:
        return f"{self.root}/versions/{v}/{group}"

    def val_key(self, v: int, path: str) -> str:
        return f"{self.root}/val/{v}/{path}.json"

    def attempts_key(self, v: int, who: int | str) -> str:
        """Attempts of phase (``who`` = trainee, v), or of an outer step from v (``who`` = "step_<group>")."""
        return f"{self.root}/attempts/{v}/" + (f"trainee_{who}" if isinstance(who, int) else who)

    def dropped_key(self, v: int, i: int) -> str:
        return f"{self.root}/dropped/{v}/trainee_{i}"

    # ------------------------------------------------------------------------------------------- commits
    @staticmethod
    def new_attempt() -> str:
        return uuid.uuid4().hex[:16]

    def put(self, base: str, attempt: str, name: str, data: bytes) -> dict:
        """Write one object of an attempt (under its own name: nothing else writes there); returns its digest entry."""
        self.storage.write(f"{base}/{attempt}/{name}", data)
        return {"sha256": sha256(data), "size": len(data)}

    def commit(self, base: str, attempt: str, objects: dict[str, dict], record: dict) -> bool:
        """Create ``base``'s commit record only if none exists: True when this attempt won."""
        body = {"attempt": attempt, "objects": objects, "record": record, "lineage": self.lineage, "time": time.time()}
        return self.storage.create_if_absent(f"{base}/commit.json", json.dumps(body).encode())

    def read_commit(self, base: str) -> dict | None:
        """``base``'s commit record, None when there is none; Damaged when it does not parse."""
        try:
            data = self.storage.read(f"{base}/commit.json")
        except FileNotFoundError:
            return None
        try:
            body = json.loads(data)
            if not isinstance(body["objects"], dict) or not isinstance(body["record"], dict):
                raise TypeError("objects and record must be tables")
            body["attempt"] = str(body["attempt"])
            return body
        except (ValueError, KeyError, TypeError) as exc:
            raise Damaged(f"{self.storage.where(base + '/commit.json')} does not parse ({exc})") from None

    def object_ref(self, base: str, body: dict, name: str) -> dict:
        if name not in body["objects"]:
            raise Damaged(f"the commit record of {self.storage.where(base)} lists no {name}")
        return ref(f"{base}/{body['attempt']}/{name}", body["objects"][name]["sha256"])

    def verify(self, base: str, body: dict) -> None:
        """Read every object of a commit and check it against its record (Damaged if one is missing or differs)."""
        for name in body["objects"]:
            self.read_ref(self.object_ref(base, body, name))

    def read_ref(self, r: dict) -> bytes:
        try:
            data = self.storage.read(r["key"])
        except FileNotFoundError:
            raise Damaged(f"{self.storage.where(r['key'])} is missing") from None
        if r["sha256"] and sha256(data) != r["sha256"]:
            raise Damaged(f"{self.storage.where(r['key'])} does not match its commit record's checksum")
        return data

    def load_tensors(self, r: dict) -> dict[str, torch.Tensor]:
        try:
            return load_safetensors(self.read_ref(r))
        except Damaged as exc:
            raise DipacoError(f"{exc}; resume the run (--resume): a damaged queue object is redone") from None
        except Exception as exc:  # a checkpoint file (no checksum) that safetensors cannot read
            raise DipacoError(f"{self.storage.where(r['key'])} is corrupt or truncated ({type(exc).__name__}); restore "
                              f"it, or resume from an earlier round") from None

    def load_state(self, r: dict) -> dict:
        try:
            data = io.BytesIO(self.read_ref(r))
            return torch.load(data, map_location="cpu", weights_only=True)
        except Damaged as exc:
            raise DipacoError(f"{exc}; resume the run (--resume): a damaged queue object is redone") from None
        except Exception as exc:
            raise DipacoError(f"{self.storage.where(r['key'])} is corrupt ({type(exc).__name__}); restore it, or "
                              f"resume from an earlier round") from None

    # ------------------------------------------------------------------------------------------- small records
    def record_attempt(self, v: int, who: int | str, where: dict) -> int:
        """Note an attempt as started; returns its number (1 for the first)."""
        key = self.attempts_key(v, who)
        self.storage.write(f"{key}/{uuid.uuid4().hex}.json", json.dumps(where).encode())
        return len(self.storage.list(key))

    def attempts(self, v: int, who: int | str) -> list[dict]:
        """The attempts started (a record that does not parse is left out: it only counts retries)."""
        key, found = self.attempts_key(v, who), []
        for name in self.storage.list(key):
            try:
                a = json.loads(self.storage.read(f"{key}/{name}"))
                found.append({"node": str(a.get("node", "")), "started": float(a["started"]), **a})
            except (ValueError, KeyError, TypeError, AttributeError, FileNotFoundError):
                continue
        return sorted(found, key=lambda a: a["started"])

    def drop(self, v: int, i: int, why: str) -> None:
        self.storage.write(self.dropped_key(v, i), (why + "\n").encode())

    def dropped(self, v: int, i: int) -> bool:
        return self.storage.exists(self.dropped_key(v, i))

    def write_val(self, v: int, path: str, loss: float) -> None:
        self.storage.create_if_absent(self.val_key(v, path), json.dumps({"loss": loss}).encode())

    def val_loss(self, v: int, path: str) -> float | None:
        """The committed validation loss, None when there is none; Damaged when the file does not hold one."""
        try:
            data = self.storage.read(self.val_key(v, path))
        except FileNotFoundError:
            return None
        try:
            return float(json.loads(data)["loss"])
        except (ValueError, KeyError, TypeError) as exc:
            raise Damaged(f"{self.storage.where(self.val_key(v, path))} does not hold a loss ({exc})") from None

    # ------------------------------------------------------------------------------------------- the driver's scan
    def scan(self, start: int, say) -> tuple[dict, dict, set, set]:
        """What the queue holds at versions >= ``start``, verified: ({(i, v): phase commit}, {(g, v): step commit},
        {(i, v) dropped}, {(path, v) validated}). Anything damaged is removed (``say`` tells the user) and redone."""
        phases, steps, dropped, vals = {}, {}, set(), set()
        for kind in ("phases", "versions"):
            for v in self._versions(kind, start):
                for who in self.storage.list(f"{self.root}/{kind}/{v}"):
                    base = f"{self.root}/{kind}/{v}/{who}"
                    try:
                        body = self.read_commit(base)
                        if body is None:
                            continue
                        self.verify(base, body)
                    except Damaged as exc:
                        say(f"{exc}: removed, the task is done again")
                        self.storage.delete(f"{base}/commit.json")
                        continue
                    if kind == "phases" and who.startswith("trainee_") and who[8:].isdigit():
                        phases[(int(who[8:]), v)] = body
                    elif kind == "versions":
                        steps[(who, v)] = body
        for v in self._versions("dropped", start):
            dropped |= {(int(n[8:]), v) for n in self.storage.list(f"{self.root}/dropped/{v}") if n[8:].isdigit()}
        for v in self._versions("val", start):
            for name in self.storage.list(f"{self.root}/val/{v}"):
                path = name.removesuffix(".json")
                try:
                    if self.val_loss(v, path) is not None:
                        vals.add((path, v))
                except Damaged as exc:
                    say(f"{exc}: removed, the validation is done again")
                    self.storage.delete(self.val_key(v, path))
        return phases, steps, dropped, vals

    def _versions(self, kind: str, start: int) -> list[int]:
        return [int(n) for n in self.storage.list(f"{self.root}/{kind}") if n.isdigit() and int(n) >= start]

    def forget_before(self, v: int) -> None:
        """Remove what no task can read any more: the queue's entries of versions below v."""
        for kind in ("phases", "attempts", "dropped", "versions", "val"):
            for name in self.storage.list(f"{self.root}/{kind}"):
                if name.isdigit() and int(name) < v:
                    self.storage.delete(f"{self.root}/{kind}/{name}")


@dataclass
class ModuleGroups:
    """Which modules take their outer step together (one task per group and version), and who feeds them."""

    modules: dict[str, list[str]]  # group -> its modules
    of_module: dict[str, str]  # module -> its group
    members: dict[str, list[int]]  # group -> the trainees whose phases its outer step averages
    of_trainee: list[list[str]]  # trainee -> the groups its path reads

    @classmethod
    def of(cls, plan, grid) -> ModuleGroups:
        modules = groups(plan.weights)
        of_module = {m: g for g, ms in modules.items() for m in ms}
        return cls(modules, of_module, {g: sorted(plan.weights[ms[0]]) for g, ms in modules.items()},
                   [sorted({of_module[m] for m in grid.path_modules(p)}) for p in plan.paths])


@dataclass
class Ledger:
    """What the driver knows storage holds (versions >= the start, verified: a resumed driver picks up every
    committed task) and what it has seen come back since."""

    phases: dict[tuple[int, int], dict]  # (trainee, v) -> the commit record of its phase from version v
    steps: dict[tuple[str, int], dict]  # (group, v) -> the commit record of its outer step to version v
    dropped: set[tuple[int, int]]  # (trainee, v): phases a quorum went on without
    validated: set[tuple[str, int]]  # (path, v): validations a phase committed
    done: set[tuple[int, int]]  # committed phases, not dropped
    versions: set[tuple[str, int]]  # (group, v): committed outer steps
    logged: set[int]  # rounds metrics.jsonl already has
    finished_at: dict[int, float]  # version -> when its last outer step came back (a round's clock; found ones: now)
    val_loss: dict[tuple[str, int], float | None] = field(default_factory=dict)  # None: too short for one window

    @classmethod
    def scan(cls, store: TaskStore, start: int, rounds: int, trainees: int, module_groups: ModuleGroups,
             local: Path, say) -> Ledger:
        phases, steps, dropped, validated = store.scan(start, say)
        dropped = {(i, v) for i, v in dropped if v < rounds and i < trainees}
        done = {(i, v) for i, v in phases if v < rounds and i < trainees and (i, v) not in dropped}
        versions = {(g, v) for g, v in steps if g in module_groups.modules and start < v <= rounds}
        finished_at = {v: time.time() for v in range(start, rounds + 1)
                       if v == start or all((g, v) in versions for g in module_groups.modules)}
        return cls(phases, steps, dropped, validated, done, versions, logged_rounds(local), finished_at)


def logged_rounds(run: Path) -> set[int]:
    f = run / "metrics.jsonl"
    rounds = set()
    for line in f.read_text(encoding="utf-8").splitlines() if f.is_file() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("kind") == "round":
            rounds.add(int(row["round"]))
    return rounds
