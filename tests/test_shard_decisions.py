"""Per-document decisions of the shard stage (sharding/decisions.py) and the row-wise routing arithmetic:
nothing may depend on how the corpus is split, ordered or batched. Fast tier: pure code."""

import random

import numpy as np
import pytest

from dipaco.routing.discriminative import DiscriminativeRouter
from dipaco.routing.kmeans import calibrate_bias, row_dot, squared_distances
from dipaco.sharding.decisions import HELDOUT, ROUTER, TRAIN, BottomK, Roles, digest, keys


def _docs(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [digest(f"document {i} {rng.random()}") for i in range(n)]


def test_keys_depend_on_the_document_and_the_seed_only():
    d = digest("some text")
    assert keys(d, 0) == keys(digest("some text"), 0)
    assert keys(d, 0) != keys(d, 1)
    role, val, sample = keys(d, 0)
    assert len({role, val, sample}) == 3 and all(0 <= k < 1 << 128 for k in (role, val, sample))


def test_bottom_k_is_the_same_for_any_split_and_order():
    items = [(keys(d, 3)[2], i) for i, d in enumerate(_docs(2000))]
    whole = BottomK(50)
    for k, p in items:
        whole.offer(k, p)
    want = whole.result()
    assert [k for k, _ in want] == sorted(k for k, _ in items)[:50]
    shuffled = items[:]
    random.Random(1).shuffle(shuffled)
    cuts = [0, 1, 2, 700, 701, 1999, 2000]  # uneven parts, one-item parts, an empty part
    parts = []
    for a, b in zip(cuts, cuts[1:] + [2000]):
        part = BottomK(50)
        for k, p in shuffled[a:b]:
            part.offer(k, p)
        parts.append(part)
    merged = BottomK(50)
    for part in reversed(parts):
        merged.merge(part)
    assert merged.result() == want
    # a document seen twice (a duplicate in another block) counts once
    again = BottomK(50).merge(whole).merge(whole)
    assert again.result() == want and again.threshold() == want[-1][0]


def test_bottom_k_threshold():
    b = BottomK(3)
    for k in (5, 1, 9):
        b.offer(k)
    assert b.threshold() == 9
    b.offer(2)
    assert b.threshold() == 5 and [k for k, _ in b.result()] == [1, 2, 5]
    assert BottomK(3).threshold() is None  # fewer than k: nothing is cut
    assert BottomK(0).threshold() == -1  # a cap of 0 keeps none


def test_roles_follow_the_fractions_and_the_caps_keep_the_smallest_keys():
    rule = Roles(0.1, 0.05, 0.2)
    ds = _docs(20_000)
    role_keys = [keys(d, 0)[0] for d in ds]
    wanted = [rule.candidate(k) for k in role_keys]
    assert wanted.count(HELDOUT) / len(ds) == pytest.approx(0.1, abs=0.01)
    assert wanted.count(ROUTER) / len(ds) == pytest.approx(0.05, abs=0.01)
    val = [rule.is_val(keys(d, 0)[1]) for d in ds]
    assert np.mean(val) == pytest.approx(0.2, abs=0.01)
    # caps: 100 held-out, 30 router documents, chosen as the candidates of smallest key
    heldout, router = BottomK(100), BottomK(30)
    for k, w in zip(role_keys, wanted):
        if w == HELDOUT:
            heldout.offer(k)
        elif w == ROUTER:
            router.offer(k)
    rule.fit(heldout, router)
    roles = [rule.role(k) for k in role_keys]
    assert roles.count(HELDOUT) == 100 and roles.count(ROUTER) == 30
    assert roles.count(TRAIN) == len(ds) - 130
    kept = sorted(k for k, r in zip(role_keys, roles) if r == HELDOUT)
    assert kept == sorted(k for k, w in zip(role_keys, wanted) if w == HELDOUT)[:100]
    # the fit sample takes training candidates by their key alone (the scan's rule): a candidate past a cap does not
    # enter it, though it trains
    assert all((rule.candidate(k) == TRAIN) == (w == TRAIN) for k, w in zip(role_keys, wanted))


def test_routing_arithmetic_has_the_same_bits_in_any_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(257, 48)).astype(np.float32)
    c = rng.normal(size=(16, 48)).astype(np.float32)
    whole = squared_distances(x, c)
    rows = np.concatenate([squared_distances(x[i:i + 1], c) for i in range(len(x))])
    thirds = np.concatenate([squared_distances(x[a:b], c) for a, b in ((0, 5), (5, 200), (200, 257))])
    assert whole.tobytes() == rows.tobytes() == thirds.tobytes()
    assert np.allclose(whole, ((x[:, None, :].astype(np.float64) - c[None]) ** 2).sum(-1), rtol=1e-5)
    assert np.allclose(row_dot(x, c), x.astype(np.float64) @ c.T.astype(np.float64))
    router = DiscriminativeRouter(None, (16,), c, rng.normal(size=16), None)
    assert router.path_distances(x).tobytes() == np.concatenate([router.path_distances(x[i:i + 1])
                                                                 for i in range(len(x))]).tobytes()


def test_calibrated_offsets_meet_the_cap_on_the_sample():
    rng = np.random.default_rng(1)
    for n, k in ((315, 4), (5000, 16), (3000, 64)):
        x, c = rng.normal(size=(n, 8)), rng.normal(size=(k, 8))
        c[0] *= 0.1  # one cluster near the middle would take most documents
        d = ((x[:, None, :] - c[None]) ** 2).sum(-1).astype(np.float32)
        bias = calibrate_bias(d, 1.1)
        counts = np.bincount((d + bias[None, :]).argmin(axis=1), minlength=k)  # in float32, as routing adds it
        assert counts.max() <= int(np.floor(1.1 * n / k)), (n, k, counts.max())
        assert np.bincount(d.argmin(axis=1), minlength=k).max() > 1.1 * n / k  # the cap did bind


def test_the_fit_thread_beside_the_tokenizer_pins_its_own_threads():
    # OpenMP's thread count is per calling thread: a thread started inside decision_threads() would run faiss
    # on OMP_NUM_THREADS threads, and a k-means sum split differently can move a document to another path.
    # The suite pins OMP_NUM_THREADS=1, so the check runs in a process where it is 2.
    import os
    import subprocess
    import sys

    probe = ("from concurrent.futures import ThreadPoolExecutor\n"
             "import faiss\n"
             "from dipaco.sharding.threads import decision_threads, in_decision_threads\n"
             "with decision_threads(), ThreadPoolExecutor(1) as beside:\n"
             "    print(beside.submit(faiss.omp_get_max_threads).result(),"
             " beside.submit(in_decision_threads, faiss.omp_get_max_threads).result())\n")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "OMP_NUM_THREADS": "2"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["2", "1"]  # a bare thread: every thread OpenMP may take; a pinned one: DECISION_THREADS
