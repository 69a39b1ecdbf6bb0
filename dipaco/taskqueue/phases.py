"""The Ray engine's tasks, without Ray: a phase, an outer step, a validation. Each reads its inputs from the run
directory, local or in a bucket (``dipaco.taskqueue.taskstore``), computes with the code every engine shares, and commits its
output with a commit record that only the first attempt creates.

  ``run_phase``    trainee i, version v: load the path's modules at version v and the trainee's state, validate the
                   path's global weights (its validator trainee), take H inner steps: the one phase every engine runs
                   (``dipaco.training.phase.train_phase``),
                   write every module's outer gradient ``Δ_i = θ_global − θ_i`` as it travels (fp32, or the
                   comm.bits payload ``Q_up(Δ_i)``) and the new trainee state (to the node cache with sticky
                   trainees; to storage unless ``durable_state`` says it may stay there alone until a checkpoint)
  ``outer_step``   a group of modules, version v -> v+1: the payloads of its phases, reduced exactly as the local
                   engine reduces them (``dipaco.training.comm.reduce_arrived``: weighted sum in trainee order, then
                   ``Q_down``), optional √P rescaling, the outer Nesterov step (``dipaco.training.outer.OuterOptimizer``)
  ``validate``     the validation loss of one path at one version, for rounds no phase validated (the last one)

Same inputs, same bits: a task pins its torch threads (``threads``, as every engine does), and nothing it computes depends on which
process or machine runs it, so a retried phase writes exactly what the lost attempt would have written.
"""

from __future__ import annotations

import io
import os
import socket
import time
from dataclasses import dataclass
from functools import partial

import torch

from dipaco.config import TrainConfig
from dipaco.errors import DipacoError
from dipaco.model.grid import Grid
from dipaco.storage.objects import sha256
from dipaco.storage.shards import ShardSet
from dipaco.taskqueue.runstore import cache_root, local_shards
from dipaco.taskqueue.taskstore import Damaged, TaskStore, state_bytes, tensors_bytes
from dipaco.training.comm import flatten, reduce_arrived, unflatten
from dipaco.training.devices import deterministic
from dipaco.training.engine_steps import rescale_and_step
from dipaco.training.outer import OuterOptimizer
from dipaco.training.phase import train_phase, validate, validation_windows
from dipaco.training.quant import dequantize, quantize
from dipaco.training.trainee import make_trainee, reusable_model


@dataclass
class PhaseSpec:
    """Everything a phase needs, resolved by the driver (small: paths, names and numbers)."""
    run: str                    # the run's location: a local path or a URL
    lineage: str                # the queue it commits into (``dipaco.taskqueue.taskstore``)
    shards: str
    cfg: TrainConfig
    grid: Grid
    trainee: int
    path: str
    sources: list[str]
    version: int
    schedule_steps: int
    modules: dict[str, dict]    # module -> its version ``version`` (``taskstore.ref``: key and checksum)
    state: dict                 # the trainee state to start from (a ref; with "replay" when only a node cache holds
    #                             it: its last durable copy and the rounds since, to rebuild it where that node is gone)
    exact_state: bool           # False: the state from before a dropped phase (its step moves to this round's)
    validate: bool              # this trainee validates its path at ``version`` (and no one has yet)
    val_sources: list[str]      # the shard paths of the path's validation windows (all its trainees' shards)
    device: str = "cpu"         # where its inner steps run (``dipaco.training.devices.phase_device``); outer state stays fp32


@dataclass
class StepSpec:
    """An outer step of one group of modules from version ``version`` to ``version + 1``."""
    run: str
    lineage: str
    cfg: TrainConfig
    group: str
    version: int
    layout: dict[str, list[str]]           # module -> its tensor names in model order (the flattening order)
    modules: dict[str, dict]               # module -> its version ``version`` (a ref)
    outer: dict                            # the momentum of version ``version`` (a ref)
    contributors: dict[int, dict]          # trainee -> its committed outer gradients (a ref)
    weights: dict[str, dict[int, float]]   # module -> {trainee: w_i} over the contributors
    paths_through: dict[str, int]


_cache: dict = {}  # per worker process: the open shard sets (a phase reopens none; its model: ``reusable_model``)


def _shards(location: str) -> ShardSet:
    if location not in _cache:
        _cache[location] = ShardSet(local_shards(location))  # a URL: copied to this machine once
    return _cache[location]


def _on(device: torch.device, modules: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    return {m: {n: t.to(device) for n, t in ts.items()} for m, ts in modules.items()}


def where() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


def run_phase(spec: PhaseSpec, node: str = "") -> dict:
    """Phase (trainee, version); returns its record (also committed as phase.json)."""
    began = time.perf_counter()
    torch.set_num_threads(spec.cfg.trainee_threads)
    device = torch.device(spec.device)
    deterministic(device)  # a retry on another GPU writes the same bytes
    store, cfg, v, i = TaskStore(spec.run, spec.lineage), spec.cfg, spec.version, spec.trainee
    attempt = store.record_attempt(v, i, where() | {"node": node})
    if attempt > 1:  # its worker or node was lost: back off (a preempted machine's replacement may need a moment)
        time.sleep(retry_backoff(attempt))
    shards = _shards(spec.shards)
    tr = make_trainee(i, spec.path, spec.sources, spec.grid, shards, cfg, model=reusable_model(cfg, shards, device))
    modules = _on(device, {m: store.load_tensors(r) for m, r in spec.modules.items()})
    cache = StateCache(spec.run, spec.lineage, i) if cfg.ray.sticky else None
    state, cached = cache.load(spec.state) if cache else (None, False)
    replayed = 0
    if state is None and "replay" in spec.state:  # kept on a node that is gone: rebuilt from the last durable copy
        state, replayed = _replay(store, spec, tr, device, cache)
    elif state is None:
        state = store.load_state(spec.state)  # AdamW's load_state_dict moves its moments to the parameters' device
    if not spec.exact_state:
        state["step"] = v * cfg.inner_steps
    tr.load_state(state)
    loaded = time.perf_counter()
    validation = partial(_val_loss, store, shards, cfg, spec.path, spec.val_sources, v, modules) if spec.validate else None
    result = train_phase(tr, cfg, v, spec.schedule_steps, modules, validation)
    computed = time.perf_counter()

    bits, block = cfg.comm.bits, cfg.comm.block_size
    base, attempt_id = store.phase_key(v, i), store.new_attempt()
    deltas = {}
    for m, delta in result.deltas.items():  # model order: the flattening order
        flat = flatten(delta)
        deltas[m] = (flat if bits == 32 else quantize(flat, bits, block)).cpu()
    sent = sum(t.numel() * t.element_size() for t in deltas.values())
    new_state = state_bytes(tr.state())
    digest = sha256(new_state)  # the cache's key and the commit record's (a paper-size state is a gigabyte: once)
    objects = {"deltas.safetensors": store.put(base, attempt_id, "deltas.safetensors", tensors_bytes(deltas))}
    if durable_state(cfg, v + 1):
        objects["state.pt"] = store.put(base, attempt_id, "state.pt", new_state)
    if cache:
        cache.keep(new_state, digest)
    loaded_bytes = sum(t.numel() * t.element_size() for ts in modules.values() for t in ts.values())
    record = {"trainee": i, "path": spec.path, "version": v, "attempt": attempt, "train_loss": result.loss,
              "inner": result.inner, "val_loss": result.val, "validated": spec.validate, "bytes_sent": sent,
              "bytes_loaded": loaded_bytes,
              "load_s": loaded - began, "val_s": result.val_s, "compute_s": result.compute_s,
              "save_s": time.perf_counter() - computed, **where(), "node": node, **store.storage.counters(),
              "state_cached": cached, "state_sha256": digest, "replayed": replayed}
    record["committed"] = store.commit(base, attempt_id, objects, record)  # last: the first attempt to commit wins
    return record


def durable_state(cfg: TrainConfig, v: int) -> bool:
    """Whether the trainee state at version ``v`` goes to storage. With sticky trainees it lives in the node cache
    between checkpoint rounds (``checkpoint_every``), where the driver assembles checkpoints from the durable copies;
    without them, or with a quorum (a dropped phase's trainee restarts from an older state), every phase writes it."""
    return not cfg.ray.sticky or cfg.ray.quorum > 0 or v % cfg.checkpoint_every == 0 or v >= cfg.rounds


def _replay(store: TaskStore, spec: PhaseSpec, tr, device: torch.device, cache: StateCache | None) -> tuple[dict, int]:
    """The trainee state at ``spec.version`` when the node that kept it is gone: its last durable copy, then the
    phases since, replayed from the same modules and data (same inputs, same bits: checked against the checksum the
    last of them committed). Costs downloads and compute, never bits; returns (state, phases replayed)."""
    chain = spec.state["replay"]
    state = store.load_state(chain["from"])
    for step in chain["rounds"]:
        tr.load_state(state)
        modules = _on(device, {m: store.load_tensors(r) for m, r in step["modules"].items()})
        train_phase(tr, spec.cfg, step["version"], spec.schedule_steps, modules)
        # through bytes, as every phase got its state: re-loading the optimizer's live state dict into it trains
        # to other bits than the phases that committed it
        data = state_bytes(tr.state())
        buf = io.BytesIO(data)
        state = torch.load(buf, map_location="cpu", weights_only=True)
    if sha256(data) != spec.state["sha256"]:
        raise DipacoError(f"replaying trainee {spec.trainee}'s phases {chain['rounds'][0]['version'] + 1}.."
                          f"{chain['rounds'][-1]['version'] + 1} gave another state than they committed (training is "
                          f"not deterministic on this machine?); resume the run (--resume) with --set "
                          f"checkpoint_every=1: every state is then durable, and the rounds since the last "
                          f"checkpoint are trained again")
    if cache:
        cache.keep(data, spec.state["sha256"])
    return state, len(chain["rounds"])


def outer_step(spec: StepSpec, node: str = "") -> dict:
    """Version ``version + 1`` of the group's modules; returns its record (also committed as step.json)."""
    began = time.perf_counter()
    store, cfg, bits, block = TaskStore(spec.run, spec.lineage), spec.cfg, spec.cfg.comm.bits, spec.cfg.comm.block_size
    base, attempt_id = store.version_key(spec.version + 1, spec.group), store.new_attempt()
    try:
        done = store.read_commit(base)
    except Damaged:
        done = None
    if done is not None:  # an earlier attempt committed it before it was lost
        return done["record"]
    store.record_attempt(spec.version, f"step_{spec.group}", where() | {"node": node})
    momentum = store.load_tensors(spec.outer)
    received, new_momentum, objects, payloads, norms = 0, {}, {}, {}, {}
    for m, names in spec.layout.items():
        loaded = store.load_tensors(spec.modules[m])
        tensors = {n: loaded[n] for n in names}
        outer = OuterOptimizer({m: tensors}, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
        outer.load_state_dict({k: t for k, t in momentum.items() if k.split("/", 1)[0] == m})
        if spec.contributors:  # a module whose every phase was dropped keeps its weights this round
            numel = sum(t.numel() for t in tensors.values())
            vectors = {}
            for i in sorted(spec.contributors):
                if i not in payloads:
                    payloads[i] = store.load_tensors(spec.contributors[i])
                sent = payloads[i].pop(m)
                received += sent.numel() * sent.element_size()
                vectors[i] = sent if bits == 32 else dequantize(sent, numel, bits, block)
            grad = unflatten(reduce_arrived(vectors, spec.weights[m], bits, block), tensors)
            rescale_and_step(outer, m, grad, cfg.grid.sqrt_rescale, spec.paths_through[m])
            norms |= outer.module_norms([m])  # the round record's per-module norms (the trackers plot them)
        objects[f"{m}.safetensors"] = store.put(base, attempt_id, f"{m}.safetensors", tensors_bytes(tensors))
        new_momentum.update(outer.state_dict())
    objects["outer.safetensors"] = store.put(base, attempt_id, "outer.safetensors", tensors_bytes(new_momentum))
    record = {"group": spec.group, "version": spec.version + 1, "contributors": sorted(spec.contributors),
              "bytes_received": received, "seconds": time.perf_counter() - began, **where(), "node": node,
              "module_norms": norms, **store.storage.counters()}
    store.commit(base, attempt_id, objects, record)
    return record


def validate_path(run: str, lineage: str, shards_dir: str, cfg: TrainConfig, grid: Grid, path: str, sources: list[str],
                  version: int, modules: dict[str, dict], device: str = "cpu") -> float | None:
    """The validation loss of ``path`` at ``version`` (written to the queue) for a round no phase validated;
    ``modules``: module -> its version ``version`` (a ref)."""
    torch.set_num_threads(cfg.trainee_threads)
    on = torch.device(device)
    deterministic(on)
    shards, store = _shards(shards_dir), TaskStore(run, lineage)
    tr = make_trainee(0, path, sources, grid, shards, cfg, model=reusable_model(cfg, shards, on))
    loaded = _on(on, {m: store.load_tensors(r) for m, r in modules.items()})
    return _val_loss(store, shards, cfg, path, sources, version, loaded, tr.model)


def _val_loss(store: TaskStore, shards: ShardSet, cfg: TrainConfig, path: str, sources: list[str], version: int,
              modules: dict, model) -> float | None:
    """The loss of ``path``'s global weights ``modules`` at ``version`` on its fixed validation windows (``sources``:
    the shard paths they come from, all its trainees' shards), written to the queue; None when they hold no window."""
    windows = validation_windows(cfg, shards, sources)
    val = validate(modules, {path: model}, {path: windows}, cfg.inner.batch_size).get(path)
    if val is not None:
        store.write_val(version, path, val)
    return val


class StateCache:
    """Trainee states kept on this node between its phases (sticky trainees): one file per trainee, named by its
    sha256, which must equal the checksum the phase's input reference holds (a stale or damaged file is a miss)."""

    def __init__(self, run: str, lineage: str, trainee: int):
        self.dir = cache_root() / "states" / sha256(run.encode())[:16] / lineage
        self.trainee = trainee

    def load(self, r: dict) -> tuple[dict | None, bool]:
        f = self.dir / f"trainee_{self.trainee}-{r['sha256']}.pt"
        if not r["sha256"] or not f.is_file():
            return None, False
        data = f.read_bytes()
        if sha256(data) != r["sha256"]:
            return None, False
        buf = io.BytesIO(data)
        return torch.load(buf, map_location="cpu", weights_only=True), True

    def keep(self, data: bytes, digest: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"trainee_{self.trainee}-{digest}.pt"
        tmp = final.with_name(f".{final.name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, final)
        for old in self.dir.glob(f"trainee_{self.trainee}-*.pt"):  # the newest state only
            if old != final:
                old.unlink(missing_ok=True)


def retry_backoff(attempt: int) -> float:
    """Seconds attempt ``attempt`` (2, 3, ...) of a task waits before it starts: 0.5, 1, 2, ... up to 30."""
    return min(30.0, 0.5 * 2 ** (attempt - 2))

