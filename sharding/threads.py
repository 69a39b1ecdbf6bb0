"""Threads of the shard stage: how many a process uses, and the fixed count of the work that decides paths.

Parallel floating-point code (BLAS, LAPACK, faiss's OpenMP, torch) may split a sum differently on a
different number of threads and round differently; a document near the boundary between two paths
then changes path. The fits (tokenizer, features, k-means, offsets) and the routing of each block
therefore run on ``DECISION_THREADS`` threads whatever ``--num-proc`` says, so the shard directory has
the same bits on one core or sixty-four. (Per-document distances of tf-idf routers are also computed
in a fixed order per row, ``dipaco.routing.kmeans.row_dot``, so they do not depend on the batch either.)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

DECISION_THREADS = 1


def set_num_proc(num_proc: int) -> int:
    """Threads for the tokenizer's Rust pool (read once, at its first use in a process); 0 = all cores."""
    n = num_proc or os.cpu_count() or 1
    if num_proc:
        os.environ["RAYON_NUM_THREADS"] = str(n)
    else:
        os.environ.setdefault("RAYON_NUM_THREADS", str(n))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    return n


@contextlib.contextmanager
def decision_threads(with_torch: bool = True):
    """Run the body with BLAS/OpenMP (threadpoolctl), faiss and torch pinned to ``DECISION_THREADS``.
    ``with_torch=False`` for a body that never computes with torch (a tf-idf router): torch is then pinned only if
    it is loaded already, and not imported for it (seconds off the start of a pass-2 worker)."""
    import faiss
    from threadpoolctl import threadpool_limits

    torch = importlib.import_module("torch") if with_torch else sys.modules.get("torch")
    before_faiss, before_torch = faiss.omp_get_max_threads(), torch.get_num_threads() if torch else 0
    faiss.omp_set_num_threads(DECISION_THREADS)
    if torch:
        torch.set_num_threads(DECISION_THREADS)
    try:
        with threadpool_limits(limits=DECISION_THREADS):
            yield
    finally:
        faiss.omp_set_num_threads(before_faiss)
        if torch:
            torch.set_num_threads(before_torch)


def in_decision_threads(fn, *args, with_torch: bool = True):
    """``fn(*args)`` inside ``decision_threads(with_torch)``: for a thread started from within that block, since
    OpenMP's thread count (faiss) belongs to the calling thread and a new thread does not inherit it."""
    with decision_threads(with_torch):
        return fn(*args)
