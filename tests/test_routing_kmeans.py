"""Flat, product, spherical, balanced and overlapping k-means routing (cluster_on=prefix: the k-means router itself),
in memory and in the shard stage."""

import collections
import json

import numpy as np
import pytest

from dipaco.routing import Router, fit_router
from dipaco.routing.kmeans import calibrate_bias
from dipaco.sharding.writer import shard
from dipaco.storage.shards import ShardSet

from conftest import shard_config


@pytest.fixture(scope="module")
def texts(corpus_file):
    return [json.loads(line)["text"] for line in open(corpus_file, encoding="utf-8")]


@pytest.mark.slow
def test_flat_and_product_routes_are_nearest_paths(texts, tok):
    flat = fit_router(texts, "4", tok, cluster_on="prefix", svd_dims=16)
    assert flat.paths == ["0", "1", "2", "3"]
    d = flat.path_distances(flat.features.transform(flat.input.texts(texts)))
    assert flat.route(texts) == [flat.paths[j] for j in d.argmin(1)]
    product = fit_router(texts, "2x2", tok, cluster_on="prefix", svd_dims=16, product_split="contiguous")
    assert [len(x) for x in product.dims] == [8, 8]
    assert len(set(product.route(texts))) >= 3


@pytest.mark.slow
def test_spherical_centroids_are_unit_vectors(texts, tmp_path, tok):
    router = fit_router(texts, "3", tok, cluster_on="prefix", svd_dims=16, spherical=True)
    assert np.allclose(np.linalg.norm(router.centroids[0], axis=1), 1.0, atol=1e-4)
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r")
    assert loaded.spherical and loaded.route(texts) == router.route(texts)


def test_calibrated_bias_caps_the_sample():
    rng = np.random.default_rng(0)
    d = rng.random((400, 4))
    d[:, 0] -= 0.5  # everything prefers cluster 0
    b = calibrate_bias(d, 1.1)
    counts = np.bincount((d + b).argmin(1), minlength=4)
    assert counts.max() <= np.ceil(1.1 * 400 / 4) and counts.min() > 0


@pytest.mark.slow
def test_balanced_router_keeps_paths_near_the_mean(texts, tmp_path, tok):
    plain = collections.Counter(fit_router(texts, "4", tok, cluster_on="prefix", svd_dims=16).route(texts))
    balanced_router = fit_router(texts, "4", tok, cluster_on="prefix", svd_dims=16, balance=1.1)
    balanced = collections.Counter(balanced_router.route(texts))
    assert max(balanced.values()) <= max(plain.values())
    assert max(balanced.values()) <= 1.25 * len(texts) / 4  # the offsets generalise from the fit sample
    balanced_router.save(tmp_path / "r")
    assert Router.load(tmp_path / "r").route(texts) == balanced_router.route(texts)  # offsets are frozen too
    # in-memory exact assignment with a cap
    assign = collections.Counter(balanced_router.assign(texts, balance=1.05))
    assert max(assign.values()) <= np.ceil(1.05 * len(texts) / 4)


@pytest.mark.slow
def test_overlap_in_memory(texts, tok):
    router = fit_router(texts, "2x2", tok, cluster_on="prefix", svd_dims=16)
    lists = router.assign(texts[:30], overlap=2)
    assert all(len(l) == 2 and l[0] != l[1] for l in lists)
    assert [l[0] for l in lists] == router.route(texts[:30])
    top = router.route_topk(texts[:30], 2)
    assert [[p for p, _ in t] for t in top] == lists


@pytest.mark.slow
def test_shard_balanced_overlap(corpus_file, shards_2x2, tmp_path):
    cfg = shard_config("4", "routing.balance=1.1", "routing.overlap=2", "data.val_fraction=0.2", "routing.batch_size=64")
    m = shard([str(corpus_file)], cfg, tmp_path / "s", tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    a = m["assignment"]
    sizes = [p["train_docs"] + p["val_docs"] for p in m["paths"].values()]
    val = sum(p["val_docs"] for p in m["paths"].values())
    train = sum(p["train_docs"] for p in m["paths"].values())
    # every training document sits in 2 paths, validation documents in exactly one
    assert val + train == m["train_documents"] + a["overlap_copies"]
    assert train == 2 * (m["train_documents"] - val) and a["overlap_copies"] == m["train_documents"] - val
    # the cap holds on the fit sample (the router's offsets), here nearly the whole corpus; the manifest
    # reports the shares reached on the corpus (first paths: overlap copies aside)
    primary = a["shares"]["documents"]
    assert sum(primary) == m["train_documents"] and len(primary) == 4
    assert a["shares"]["max_over_mean"] == pytest.approx(max(primary) * 4 / sum(primary), abs=1e-4)
    assert a["shares"]["within_cap"] and a["shares"]["max_over_mean"] <= 1.1
    assert sum(sizes) - a["overlap_copies"] == m["train_documents"]
    assert m["path_sizes"]["max"] == max(sizes) and len(m["path_sizes"]["counts"]) >= 1
    s = ShardSet(tmp_path / "s")
    heldout = s.heldout()
    assert all(isinstance(d["path"], str) for d in heldout)  # held-out: one path each
    tok = s.tokenizer()
    for p in s.paths:  # the two copies of a document are identical token runs in two paths
        assert len(s.doc_offsets(p)) - 1 == m["paths"][p]["train_docs"]
    first = {p: tok.decode(np.asarray(s.tokens(p)[: s.doc_offsets(p)[1]]).tolist()) for p in s.paths}
    everything = {p: tok.decode(np.asarray(s.tokens(p)).tolist()) for p in s.paths}
    for p, doc in first.items():
        assert sum(doc in text for text in everything.values()) >= 2
