"""Where the shard stage's block tasks run: this process, local worker processes, or Ray.

Every task is a plain function of its arguments that writes a committed part and returns a small dict, so
the engine only decides where it runs: the bytes are the same on any engine and any number of workers.

  local, 1 worker     in this process (the default for a corpus of one block: no start-up cost)
  local, N workers    a pool of N spawned processes, one block each at a time, the tokenizer on one thread in
                      each (one core per worker, rather than one process with N tokenizer threads: bench/shard.py)
  ray                 Ray tasks (``dipaco.taskqueue.ray_tasks``) on the cluster at --address, or on a local Ray; a task
                      whose worker or node is lost is retried and writes the same bytes
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from tqdm.auto import tqdm

from dipaco.errors import DipacoError
from dipaco.children import die_with_parent

# what every worker runs with: one tokenizer thread and one BLAS/torch thread (a worker is one core)
WORKER_ENV = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# pass 2's modules (scikit-learn, scipy, faiss: seconds to import) load in the background of a worker's first
# task, while it scans and the driver fits, instead of delaying its first pass-2 block
PRELOAD = ("dipaco.sharding.parts",)


def worker_env() -> dict[str, str]:
    return dict(WORKER_ENV)


def _init_worker(env: dict[str, str], parent: int) -> None:
    die_with_parent(parent)  # a killed shard command takes its workers with it (each holds a tokenizer, a router)
    os.environ.update(env)
    for module in PRELOAD:
        threading.Thread(target=importlib.import_module, args=(module,), daemon=True).start()


class Engine:
    """Runs ``fn(*args)`` for every tuple of arguments; ``run`` returns the results in the given order and
    calls ``on_result(i, result)`` in this process as each task finishes (in any order). ``order``: the
    indices in the order to start the tasks (a pool's workers take them first come, first served; one
    process runs them as given)."""

    kind, workers = "local", 1

    def __init__(self, progress: bool = True):
        self.progress = progress

    def _bar(self, total: int, desc: str):
        return tqdm(total=total, desc=desc, unit="block", disable=not self.progress or total < 2, dynamic_ncols=True)

    def run(self, fn, arglist: list[tuple], desc: str = "", on_result=None, order=None) -> list:
        out = []
        with self._bar(len(arglist), desc) as bar:
            for i, args in enumerate(arglist):
                out.append(fn(*args))
                if on_result is not None:
                    on_result(i, out[-1])
                bar.update(1)
        return out

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"engine": self.kind, "workers": self.workers}


class LocalPool(Engine):
    """N spawned worker processes (spawn, not fork: the driver holds threads of torch, faiss and tokenizers)."""

    def __init__(self, workers: int, progress: bool = True):
        super().__init__(progress)
        self.workers = workers
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init_worker, initargs=(worker_env(), os.getpid()))

    def run(self, fn, arglist: list[tuple], desc: str = "", on_result=None, order=None) -> list:
        futures: list = [None] * len(arglist)
        for i in range(len(arglist)) if order is None else order:
            futures[i] = self.pool.submit(fn, *arglist[i])
        index = {f: i for i, f in enumerate(futures)}
        try:
            with self._bar(len(futures), desc) as bar:
                for f in as_completed(futures):
                    if on_result is not None:
                        on_result(index[f], f.result())
                    bar.update(1)
            out = [f.result() for f in futures]
        except BrokenProcessPool:
            raise DipacoError("a shard worker process died (out of memory, or killed); committed blocks are kept: "
                              "rerun the same command with --resume") from None
        finally:
            for f in futures:
                f.cancel()
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class RayEngine(Engine):
    kind = "ray"

    def __init__(self, address: str, cpus: int, max_retries: int, progress: bool = True):
        super().__init__(progress)
        try:
            from dipaco.taskqueue.ray_tasks import RayTasks
        except ImportError:
            raise DipacoError("--engine ray needs Ray; install it with pip install -e '.[ray]' (or pip install 'ray>=2.40')") from None
        self.tasks = RayTasks(address, cpus, max_retries, worker_env(), PRELOAD)
        self.workers = self.tasks.cpus

    def run(self, fn, arglist: list[tuple], desc: str = "", on_result=None, order=None) -> list:
        def done(i, result):
            if on_result is not None:
                on_result(i, result)
            bar.update(1)

        with self._bar(len(arglist), desc) as bar:
            return self.tasks.run(fn, arglist, on_done=done, order=order)

    def close(self) -> None:
        self.tasks.close()


def make_engine(engine: str, num_proc: int, address: str, blocks: int, max_retries: int = 3,
                progress: bool = True) -> Engine:
    if engine == "ray":
        return RayEngine(address, num_proc or os.cpu_count() or 1, max_retries, progress)
    if address:
        raise DipacoError(f"--address {address} is a Ray cluster's; add --engine ray, or drop --address")
    workers = min(num_proc or os.cpu_count() or 1, max(1, blocks))
    return Engine(progress) if workers == 1 else LocalPool(workers, progress)
