"""A run directory through the storage interface: its checkpoints, the queue's lineage, finished rounds assembled
into checkpoints, and local copies of a run or shard directory kept in a bucket.

A run in a bucket has the layout of a local one (``dipaco.storage.run``, ``dipaco.storage.checkpoint``). Commands that read it
(eval, generate, export, the driver's checks) work on a local copy (``pull_run``: the run's small files, and the
checkpoints they need); the driver writes back what it changes (``push``). Shards given as a URL are copied once per
machine into a local cache (``local_shards``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

from dipaco.config import TrainConfig, to_dict
from dipaco.errors import DipacoError
from dipaco.storage import checkpoint
from dipaco.storage.objects import Storage, is_url
from dipaco.taskqueue.taskstore import TaskStore, state_bytes, tensors_bytes

HEAD_FILES = ("config.toml", "run.json", "metrics.jsonl")
TRACKER_FILES = ("trackers.json", "tensorboard")  # --log-to: which rounds the trackers have, and the event files


# ------------------------------------------------------------------------------------------ checkpoints in storage
def rounds_in(storage: Storage) -> list[int]:
    """The complete rounds (their meta.json, written last, is there)."""
    names = [n for n in storage.list("checkpoints") if n.startswith("round_") and n[6:].isdigit()]
    return sorted(int(n[6:]) for n in names if storage.exists(f"checkpoints/{n}/state/meta.json"))


def assemble(store: TaskStore, local: Path, v: int, modules: dict[str, dict], outer: list[dict], states: list[tuple],
             meta: dict) -> None:
    """Round v's checkpoint from the queue's committed objects: ``modules`` {module: ref}, ``outer`` the groups'
    momentum refs, ``states`` [(ref, exact, step)] per trainee (not exact: the state from before a dropped phase,
    moved to this round's ``step``). Locally: links (copies across file systems) into a temporary directory renamed
    into place; in a bucket: copies, meta.json then ``latest`` written last. ``latest`` moves last either way."""
    momentum = {}
    for r in outer:
        momentum.update(store.load_tensors(r))
    meta = {**meta, "queue": store.lineage}
    if not store.storage.remote:
        tmp = checkpoint.begin_round(local, v)
        try:
            for m, r in modules.items():
                store.storage.copy(r["key"], str((tmp / "modules" / f"{m}.safetensors").relative_to(local)))
            for i, (r, exact, step) in enumerate(states):
                target = str((tmp / "state" / f"trainee_{i}.pt").relative_to(local))
                if exact:
                    store.storage.copy(r["key"], target)
                else:
                    torch.save({**store.load_state(r), "step": step}, tmp / "state" / f"trainee_{i}.pt")
            checkpoint.finish_round(local, v, tmp, list(modules), momentum, len(states), meta)
        except BaseException:
            checkpoint.abort_round(tmp)
            raise
        return
    s, base = store.storage, f"checkpoints/round_{v}"
    for m, r in modules.items():
        s.copy(r["key"], f"{base}/modules/{m}.safetensors")
    for i, (r, exact, step) in enumerate(states):
        if exact:
            s.copy(r["key"], f"{base}/state/trainee_{i}.pt")
        else:
            s.write(f"{base}/state/trainee_{i}.pt", state_bytes({**store.load_state(r), "step": step}))
    s.write(f"{base}/state/outer.safetensors", tensors_bytes(momentum))
    meta_bytes = json.dumps({"round": v, "modules": list(modules), **meta}, indent=1).encode()
    s.write(f"{base}/state/meta.json", meta_bytes)
    s.write("checkpoints/latest", f"round_{v}\n".encode())
    (local / base / "state").mkdir(parents=True, exist_ok=True)  # the driver's local view follows
    (local / base / "state" / "meta.json").write_bytes(meta_bytes)
    (local / "checkpoints" / "latest").write_text(f"round_{v}\n")


# ------------------------------------------------------------------------------------------ the queue's lineage
def config_digest(cfg: TrainConfig, schedule_steps: int) -> str:
    """What decides the bits a queue holds: a queue grown under another digest is not read."""
    d = to_dict(cfg)
    keep = {k: d[k] for k in ("model", "grid", "inner", "outer", "seed", "inner_steps")}
    keep["threads"] = cfg.trainee_threads
    keep["comm"] = {k: d["comm"][k] for k in ("bits", "block_size")}
    keep["schedule_steps"] = schedule_steps
    durable_every = cfg.checkpoint_every if cfg.ray.sticky and not cfg.ray.quorum else 1
    if durable_every != 1:  # which phases wrote a durable trainee state (checkpoints are assembled from those;
        keep["durable"] = [durable_every, cfg.rounds]  # the last round's always is)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def choose_lineage(storage: Storage, start: int, digest: str, start_meta: dict, say) -> str:
    """The queue lineage a driver starting from checkpoint ``start`` may use: the stored one when it grew from that
    checkpoint (its base, or a round assembled from it) under the same config ``digest``; else a new one, and every
    other queue folder is deleted (nothing in it derives from this checkpoint)."""
    current = None
    try:
        current = json.loads(storage.read("queue/lineage.json"))
        token, base, stored = str(current["token"]), int(current["base"]), str(current["digest"])
        if start > 0 and stored == digest and (base == start or start_meta.get("queue") == token):
            return token
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        say(f"{storage.where('queue/lineage.json')} does not parse: the queue is started afresh")
    old = [n for n in storage.list("queue") if n != "lineage.json"]
    if old and start > 0:
        say(f"the queue in {storage.where('queue')} did not grow from round {start}'s checkpoint with this config: "
            f"it is not read (removed), and round {start + 1} on is trained afresh")
    for name in old:
        storage.delete(f"queue/{name}")
    token = uuid.uuid4().hex[:12]
    storage.write("queue/lineage.json", json.dumps({"token": token, "base": start, "digest": digest}).encode())
    return token


# ------------------------------------------------------------------------------------------ local copies
def cache_root() -> Path:
    return Path(os.environ.get("DIPACO_CACHE") or Path.home() / ".cache" / "dipaco")


def _cache_dir(kind: str, url: str) -> Path:
    return cache_root() / kind / hashlib.sha256(url.encode()).hexdigest()[:16]


def pull_run(location: str | Path, rounds: str = "all", into: Path | None = None) -> Path:
    """A local directory holding the run: the run itself when it is local; for a URL a copy of its small files and,
    per complete round, its meta.json (``rounds="meta"``: enough for the driver's checks) or all its files ("all")."""
    if not is_url(str(location)):
        return Path(location)
    storage = Storage(str(location))
    local = into or _cache_dir("runs", str(location))
    local.mkdir(parents=True, exist_ok=True)
    for name in HEAD_FILES + TRACKER_FILES[:1] + ("checkpoints/latest",):
        if storage.exists(name):
            storage.get_file(name, local / name)
    for name in storage.list(TRACKER_FILES[1]):  # a new driver appends to the same tracker run
        storage.get_file(f"{TRACKER_FILES[1]}/{name}", local / TRACKER_FILES[1] / name)
    for r in rounds_in(storage):
        base = f"checkpoints/round_{r}"
        names = ["state/meta.json"] if rounds == "meta" else [f"{d}/{n}" for d in ("modules", "state")
                                                                for n in storage.list(f"{base}/{d}")]
        for name in names:
            if rounds == "meta" or not (local / base / name).is_file():  # a complete round's files never change
                storage.get_file(f"{base}/{name}", local / base / name)
    return local


MIRROR_PREFIX = "dipaco-run-"


def driver_mirror() -> Path:
    """A new temporary folder for the driver's local view of a run in a bucket, named by the driver's pid. Every
    exit of the driver removes its own (``driver_view``); the mirrors of drivers that were killed (no exit ran) are
    removed by the next driver on this machine."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{MIRROR_PREFIX}*-*"):
        pid = old.name[len(MIRROR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{MIRROR_PREFIX}{os.getpid()}-"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextmanager
def driver_view(location: str):
    """The driver's run directory on this machine: the run itself when it is local, else a mirror of a bucket run's
    small files, removed on every way out. A message about the run names the URL, never the mirror (a folder the
    user has never seen, and that is gone by then). A local run folder this command created and left empty (it
    could not start) is removed too."""
    if not is_url(location):
        folder = Path(location)
        existed = folder.exists()
        try:
            yield folder
        finally:
            if not existed and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        return
    local = driver_mirror()
    try:
        pull_run(location, "meta", into=local)
        yield local
    except DipacoError as exc:
        raise type(exc)(str(exc).replace(str(local), location)) from None
    finally:
        shutil.rmtree(local, ignore_errors=True)


def push(local: Path, storage: Storage, names: list[str]) -> None:
    """Upload files (or whole folders) of the local copy to the run in storage (no-op for a local run)."""
    if not storage.remote:
        return
    for name in names:
        p = local / name
        files = [f for f in sorted(p.rglob("*")) if f.is_file()] if p.is_dir() else [p] if p.is_file() else []
        for f in files:
            storage.write(str(f.relative_to(local)), f.read_bytes())


def local_shards(location: str | Path | None) -> Path | None:
    """A shard directory on this machine: the path itself, or for a URL a copy made once per machine (a marker file
    written last says the copy is whole). None (no --shards: the run's own record names them) stays None."""
    if location is None:
        return None
    if not is_url(str(location)):
        return Path(location)
    local = _cache_dir("shards", str(location))
    if (local / ".dipaco-copied").is_file():
        return local
    storage, todo = Storage(str(location)), [""]
    while todo:
        prefix = todo.pop()
        for name in storage.list(prefix):
            key = f"{prefix}/{name}" if prefix else name
            if storage.fs.isdir(storage.where(key)):
                todo.append(key)
            else:
                storage.get_file(key, local / key)
    (local / ".dipaco-copied").write_text(str(location))
    return local
