"""Plain retried Ray tasks for a stage's independent pieces of work (``dipaco shard --engine ray``'s blocks).

The shard stage hands over functions of its own (``dipaco.sharding.scan``, ``.parts``); this file only runs them,
so it imports no stage, and Ray stays in the files listed in tests/test_imports.py. A task whose worker
process or node is lost is retried ``max_retries`` times; an exception raised by the task itself is not
retried (it would raise again) and reaches the driver as itself.
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable

import ray
from ray.exceptions import RayTaskError

from dipaco.taskqueue.ray_cluster import connect, disconnect


_preloading: threading.Thread | None = None  # per worker process


def _call(preload: tuple[str, ...], fn, *args):
    # A worker's first task starts importing the modules of the stage's later tasks beside it, so that a later
    # task does not import them on its critical path (the shard stage's pass 2: scikit-learn, scipy, faiss)
    global _preloading
    if preload and _preloading is None:
        _preloading = threading.Thread(target=lambda: [importlib.import_module(m) for m in preload], daemon=True)
        _preloading.start()
    return fn(*args)


class RayTasks:
    def __init__(self, address: str, cpus: int, max_retries: int, env: dict[str, str], preload: tuple[str, ...] = ()):
        self.started = not ray.is_initialized()
        if self.started:  # a local Ray kept to 127.0.0.1 without a dashboard, or the cluster at address (one place)
            connect(address, cpus, env)
        self.cpus = int(ray.cluster_resources().get("CPU", cpus))
        # SPREAD: with the default (local node first), a pass's first tasks wait on the driver's node while the
        # other nodes' workers sit idle (docs/sharding.md)
        self.remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False,
                                 scheduling_strategy="SPREAD")(_call)
        self.preload = tuple(preload)

    def run(self, fn, arglist: list[tuple], on_done: Callable[[int, object], None] = lambda i, result: None,
            order: list[int] | None = None) -> list:
        refs: list = [None] * len(arglist)
        for i in range(len(arglist)) if order is None else order:  # Ray schedules them in submission order
            refs[i] = self.remote.remote(self.preload, fn, *arglist[i])
        index = {ref: i for i, ref in enumerate(refs)}
        out: list = [None] * len(refs)
        waiting = list(refs)
        try:
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                for ref in done:
                    try:
                        out[index[ref]] = ray.get(ref)
                    except RayTaskError as exc:  # the task's own exception, as itself (a DipacoError stays one line)
                        cause = getattr(exc, "cause", None)
                        raise (cause if isinstance(cause, Exception) else exc) from None
                    on_done(index[ref], out[index[ref]])
        finally:
            for ref in waiting:
                ray.cancel(ref, force=True)
        return out

    def close(self) -> None:
        if self.started:
            disconnect()
