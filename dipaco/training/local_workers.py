"""Where the local engine runs a round's phases: in this process, or side by side in local worker processes.

  ``InProcess``     every phase in this process, one after another (a world of one, or a torchrun rank's trainees)
  ``WorkerPool``    N spawned processes, one torch thread each (as a Ray phase runs), each taking the next phase:
                    a phase gets the trainee's state and its path's global weights as bytes, and gives back the new
                    state, the outer gradients and the record as bytes

The outer step stays in this process, so the pool changes where phases run, never what they compute: a phase
loads its trainee's state from bytes as a Ray phase does, and AdamW continued from a state read back from bytes takes
the same steps as the one kept alive, so the modules are those of one process, bit for bit.
"""

from __future__ import annotations

import io
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable

import torch

from dipaco.children import die_with_parent
from dipaco.config import TrainConfig
from dipaco.storage.shards import ShardSet
from dipaco.training.devices import deterministic
from dipaco.training.phase import PhaseResult, train_phase
from dipaco.training.trainee import Trainee, make_trainee, reusable_model


def default_workers(num_trainees: int) -> int:
    """The local engine's default: one worker process per core, never more than there are trainees."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                      num_trainees))


class InProcess:
    """Every phase in this process, in trainee order."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def run(self, trainees: list[Trainee], version: int, schedule_steps: int, modules: dict,
            advance: Callable[[int], None]) -> list[PhaseResult]:
        out = []
        for tr in trainees:
            out.append(train_phase(tr, self.cfg, version, schedule_steps, modules))
            advance(self.cfg.inner_steps)
        return out

    def close(self) -> None:
        pass


class WorkerPool:
    """``workers`` spawned processes running the phases of one round at a time (spawn, not fork: this process
    holds torch's threads)."""

    def __init__(self, cfg: TrainConfig, shards_dir: str, grid, workers: int):
        self.cfg, self.shards_dir, self.grid = cfg, str(shards_dir), grid
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_start_worker, initargs=(cfg.trainee_threads, os.getpid()))
        for _ in range(workers):  # every process starts (and imports torch) now, not one by one as phases come
            self.executor.submit(os.getpid)

    def run(self, trainees: list[Trainee], version: int, schedule_steps: int, modules: dict,
            advance: Callable[[int], None]) -> list[PhaseResult]:
        futures = {}
        for tr in trainees:
            path_modules = {m: modules[m] for m in tr.model.module_params}
            job = _to_bytes({"state": tr.state(), "modules": path_modules})
            futures[self.executor.submit(_phase_in_worker, self.cfg, self.shards_dir, self.grid, tr.index, tr.path,
                                         tr.sources, version, schedule_steps, job)] = tr
        results = {}
        for future in as_completed(futures):
            tr = futures[future]
            record, data = future.result()
            back = _from_bytes(data)
            tr.load_state(back["state"])
            results[tr.index] = PhaseResult(**record, deltas=back["deltas"])
            advance(self.cfg.inner_steps)
        return [results[tr.index] for tr in trainees]

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _start_worker(threads: int, parent: int) -> None:
    # a SIGKILLed trainer cannot shut its pool down: its workers end with it, or they would hold its output pipes
    # (and a core) until their phase ends
    die_with_parent(parent)
    torch.set_num_threads(threads)  # one core per worker: every engine pins the same count (the same bits)
    deterministic(torch.device("cpu"))


_shard_sets: dict[str, ShardSet] = {}  # per worker process: the shard sets it has opened


def _phase_in_worker(cfg: TrainConfig, shards_dir: str, grid, index: int, path: str, sources: list[str], version: int,
                     schedule_steps: int, job: bytes) -> tuple[dict, bytes]:
    if shards_dir not in _shard_sets:
        _shard_sets[shards_dir] = ShardSet(shards_dir)
    shards = _shard_sets[shards_dir]
    device = torch.device("cpu")
    tr = make_trainee(index, path, sources, grid, shards, cfg, device, model=reusable_model(cfg, shards, device))
    given = _from_bytes(job)
    tr.load_state(given["state"])
    result = train_phase(tr, cfg, version, schedule_steps, given["modules"])
    record = {k: getattr(result, k) for k in ("trainee", "loss", "inner", "val", "val_s", "compute_s")}
    return record, _to_bytes({"state": tr.state(), "deltas": result.deltas})
