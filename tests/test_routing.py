import collections

import numpy as np
import pytest

from dipaco.errors import DipacoError
from dipaco.routing import Router, fit_router
from dipaco.routing.kmeans import balanced_assignment, split_dims


@pytest.fixture(scope="module")
def texts(corpus_file):
    import json

    return [json.loads(line)["text"] for line in open(corpus_file, encoding="utf-8")]


@pytest.mark.slow
def test_fit_save_load_route_round_trip(texts, tmp_path, tok):
    router = fit_router(texts, "4", tok, cluster_on="prefix", svd_dims=16, seed=0)
    routes = router.route(texts)
    assert set(routes) <= {"0", "1", "2", "3"} and len(set(routes)) > 1
    router.save(tmp_path / "router")
    loaded = Router.load(tmp_path / "router")
    assert loaded.route(texts) == routes
    assert np.allclose(loaded.features.transform(texts[:20]), router.features.transform(texts[:20]), atol=1e-6)


def test_tfidf_fit_transform_is_fit_then_transform_to_the_bit(texts):
    # the router fit projects its sample from the fit's own matrix instead of tokenizing it again; a flipped
    # last bit would move a document near a boundary to another path, so the bits must be transform's
    from dipaco.routing.features import TfidfFeatures

    sample = texts[:300] + ["Numbers 1999 and 2024 fold to 0000; CASE folds too.", "the the the and of"]
    once = TfidfFeatures(prefix_chars=512, max_features=400, dims=16, seed=3).fit_transform(sample)
    twice = TfidfFeatures(prefix_chars=512, max_features=400, dims=16, seed=3).fit(sample)
    assert once.dtype == np.float32 and once.shape == (len(sample), 16)
    assert np.array_equal(once.view(np.uint32), twice.transform(sample).view(np.uint32))


@pytest.mark.slow
def test_deterministic_under_a_seed(texts, tok):
    a = fit_router(texts, "2x2", tok, cluster_on="prefix", svd_dims=16, seed=3).route(texts)
    b = fit_router(texts, "2x2", tok, cluster_on="prefix", svd_dims=16, seed=3).route(texts)
    assert a == b


@pytest.mark.slow
def test_product_kmeans_path_ids_are_tuples_of_level_centroids(texts, tok):
    router = fit_router(texts, "2x3", tok, cluster_on="prefix", svd_dims=16, seed=0)
    assert router.paths == [f"{i}-{j}" for i in range(2) for j in range(3)]
    x = router.features.transform(router.input.texts(texts[:50]))  # the router reads the decoded first 32 tokens
    d0, d1 = router.level_distances(x)
    expected = [f"{i}-{j}" for i, j in zip(d0.argmin(1), d1.argmin(1))]
    assert router.route(texts[:50]) == expected
    # the path distance is the sum of the level distances, and top-1 agrees with route()
    top = router.route_topk(texts[:50], 3)
    assert [t[0][0] for t in top] == expected
    assert all(t[0][1] <= t[1][1] <= t[2][1] for t in top)


def test_split_dims():
    assert [d.tolist() for d in split_dims(6, 2, "interleaved")] == [[0, 2, 4], [1, 3, 5]]
    assert [d.tolist() for d in split_dims(6, 2, "contiguous")] == [[0, 1, 2], [3, 4, 5]]


def test_balanced_assignment_caps_every_cluster():
    rng = np.random.default_rng(0)
    d = rng.random((100, 4))
    d[:, 0] -= 1.0  # everything prefers cluster 0
    a = balanced_assignment(d, 1.1)
    counts = collections.Counter(a.tolist())
    assert max(counts.values()) <= 28 and len(counts) == 4
    assert (a >= 0).all()
    with pytest.raises(DipacoError):
        balanced_assignment(d, 0.5)


@pytest.mark.slow
def test_bad_router_input(texts, tmp_path, tok):
    router = fit_router(texts, "2", tok, cluster_on="prefix", svd_dims=8)
    with pytest.raises(DipacoError, match="list of texts"):
        router.route("one string")
    with pytest.raises(DipacoError, match="needs strings"):
        router.route([1, 2])
    assert router.route([]) == []
    assert len(router.route(["", "\x00\x01 binary"])) == 2  # empty or odd text still gets a path
    with pytest.raises(DipacoError, match="router.json"):
        Router.load(tmp_path / "nowhere")
