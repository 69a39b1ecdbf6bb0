"""Fitting the router that shards (and, frozen, answers): one function for every kind.

Every router reads the decoded first ``prefix_tokens`` tokens of a document (``PrefixInput``). What
differs is how its paths are defined:

  assign="kmeans", cluster_on="prefix"    (product) k-means on the prefix features themselves
  assign="kmeans", cluster_on="document"  (product) k-means on tf-idf features of the first
                                          ``prefix_chars`` characters of each document defines the
                                          paths (the *target*); a multinomial logistic regression
                                          on the prefix features learns to predict them, with a bias
                                          that keeps the target's path shares. That classifier is
                                          the router: the prefix decision is the one both stages use
  assign="random"                         a seeded hash of the prefix (the i.i.d. control)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from dipaco.config import apply_dict
from dipaco.shard_config import RoutingConfig
from dipaco.model.grid import parse_grid
from dipaco.routing.discriminative import fit_discriminative
from dipaco.routing.features import TfidfFeatures, make_features
from dipaco.routing.kmeans import calibrate_bias
from dipaco.routing.prefix import PrefixInput
from dipaco.routing.router import BaseRouter, HashRouter, Router, _check_texts


def routing_config(cfg: RoutingConfig | None = None, **overrides) -> RoutingConfig:
    """A copy of ``cfg`` (or the defaults) with keyword overrides, checked like a config file."""
    out = dataclasses.replace(cfg) if cfg is not None else RoutingConfig()
    apply_dict(out, overrides, "routing.")
    return out


def document_target(texts: list[str], grid: str, seed: int = 0, cfg: RoutingConfig | None = None,
                    **overrides) -> np.ndarray | None:
    """The paths of a ``cluster_on="document"`` router: (product) k-means labels of the fit sample on
    tf-idf of each whole document's first ``prefix_chars`` characters; None for the other kinds. It needs
    no tokenizer, so the shard stage computes it while the tokenizer trains."""
    r = routing_config(cfg, **overrides)
    if r.assign == "random" or r.cluster_on == "prefix":
        return None
    texts = _check_texts(texts)
    doc = TfidfFeatures(r.prefix_chars, r.max_tfidf_features, r.svd_dims, seed)
    xd = doc.fit_transform(texts)
    target = Router.fit_features(doc, xd, parse_grid(grid), None, **_kmeans_args(r, seed))
    return target.path_distances(xd).argmin(axis=1)


def _kmeans_args(r: RoutingConfig, seed: int) -> dict:
    return dict(kmeans_iters=r.kmeans_iters, product_split=r.product_split, seed=seed, spherical=r.spherical,
                balance=r.balance, kmeans_restarts=r.kmeans_restarts)


def fit_router(texts: list[str], grid: str, tokenizer, seed: int = 0, progress: bool = False,
               cfg: RoutingConfig | None = None, target: np.ndarray | Callable[[], np.ndarray] | None = None,
               **overrides) -> BaseRouter:
    """Fit a router on ``texts`` (a sample of whole documents): ``cfg`` fields, or keyword overrides of
    them (``fit_router(texts, "2x2", tok, svd_dims=16)``). ``target``: ``document_target`` of the same
    texts and settings, or a function that returns it, called only once the prefix features are fitted (the
    shard stage computes the target on another thread meanwhile)."""
    r = routing_config(cfg, **overrides)
    shape = parse_grid(grid)
    texts = _check_texts(texts)
    prefix = PrefixInput.of(tokenizer, r.prefix_tokens)
    if r.assign == "random":
        return HashRouter(shape, prefix, seed)
    prefixes = prefix.texts(texts)
    feats = make_features(r.features, r.prefix_chars, r.max_tfidf_features, r.svd_dims, seed, r.feature_model or None,
                          r.prefix_tokens, r.feature_batch_size, r.copy_feature_model)
    feats.progress = progress
    x = feats.fit_transform(prefixes)
    if r.cluster_on == "prefix":
        return Router.fit_features(feats, x, shape, prefix, **_kmeans_args(r, seed))
    # Paths defined on whole-document features, learned from the prefix.
    labels = document_target(texts, grid, seed, r) if target is None else target() if callable(target) else target
    if len(labels) != len(texts):
        raise ValueError(f"fit_router: a target of {len(labels)} labels for {len(texts)} texts")
    shares = np.bincount(labels, minlength=int(np.prod(shape))).astype(np.float64) + 1.0
    router = fit_discriminative(feats, x, labels, shape, shares, prefix, seed)
    if r.balance > 0:  # the classifier's argmax must respect the cap too: the shard stage routes by it
        router.intercept -= calibrate_bias(router.path_distances(x), r.balance)
    agree = float((router.path_distances(x).argmin(axis=1) == labels).mean())
    router.info.update({"target": "document k-means", "target_chars": r.prefix_chars,
                        "target_agreement_on_fit_sample": round(agree, 4)})
    return router
