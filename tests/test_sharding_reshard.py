"""Discriminative re-sharding from a tiny trained run: loss labels -> logistic-regression router -> new shards."""

import json

import numpy as np
import pytest

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.routing import Router
from dipaco.routing.discriminative import DiscriminativeRouter, match_bias
from dipaco.sharding.writer import shard
from dipaco.storage.shards import ShardSet
from dipaco.training.train import train

from conftest import shard_config, tiny_train_config


def test_match_bias_hits_the_target():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(300, 4))
    logits[:, 0] += 3.0  # a collapsed classifier
    target = np.array([0.4, 0.3, 0.2, 0.1])
    b = match_bias(logits, target)
    z = logits + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert np.allclose(p.mean(0), target, atol=1e-3)


@pytest.fixture(scope="module")
def trained(corpus_file, shards_2x2, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    cfg = shard_config("2x2", "data.router_fraction=0.15", "data.heldout_fraction=0.05")
    shard([str(corpus_file)], cfg, root / "shards", tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    train(tiny_train_config(rounds=1, inner_steps=8), root / "shards", root / "run", progress=False)
    return root


@pytest.mark.slow
def test_reshard_cli_end_to_end(trained, capsys):
    src, out = trained / "shards", trained / "shards2"
    assert main(["reshard", "--run", str(trained / "run"), "--shards", str(src), "--out", str(out), "--quiet",
                 "--max-tokens", "160"]) == 0
    printed = capsys.readouterr().out
    assert "moved" in printed and "accuracy" in printed
    old, new = ShardSet(src), ShardSet(out)
    report = new.manifest["reshard"]
    assert 0.0 <= report["moved_share"] <= 1.0 and 0.0 <= report["accuracy"] <= 1.0
    assert report["test_documents"] >= 1 and report["fit_documents"] > report["test_documents"]
    # same documents and tokens, same tokenizer, validation stays validation
    for key in ("train_docs", "val_docs", "train_tokens", "val_tokens"):
        assert sum(p[key] for p in new.manifest["paths"].values()) == sum(p[key] for p in old.manifest["paths"].values())
    assert new.manifest["tokenizer"]["sha256"] == old.manifest["tokenizer"]["sha256"]
    assert new.fingerprint != old.fingerprint
    # the new router is discriminative, loads through Router.load and routes like the manifest says
    router = Router.load(out / "router")
    assert isinstance(router, DiscriminativeRouter) and router.paths == old.paths
    assert router.input.tokens == 32 and new.manifest["route_agreement"]["heldout"] == 1.0  # the prefix, like every router
    heldout = new.heldout()
    assert router.route([d["text"] for d in heldout]) == [d["path"] for d in heldout]
    # the bias keeps the distribution near the current shard sizes: no path collapses
    sizes = [p["train_docs"] + p["val_docs"] for p in new.manifest["paths"].values()]
    assert min(sizes) > 0 and max(sizes) <= 0.8 * sum(sizes)
    # the moved share is what the two routers disagree on
    moved = report["moved_documents"]
    assert moved == round(report["moved_share"] * report["documents"])
    # every document of the new shards ends with EOS and offsets match the counts
    for p in new.paths:
        offsets = new.doc_offsets(p)
        assert len(offsets) - 1 == new.manifest["paths"][p]["train_docs"]
        if len(offsets) > 1:
            assert (new.tokens(p)[offsets[1:] - 1] == new.eos_token_id).all()


@pytest.mark.slow
def test_reshard_refuses_mismatched_inputs(trained, shards_2x2, tmp_path):
    from dipaco.sharding.reshard import reshard

    with pytest.raises(DipacoError, match="trained on other shards"):
        reshard(trained / "run", shards_2x2, tmp_path / "x", progress=False)
    with pytest.raises(DipacoError, match="already exists"):
        reshard(trained / "run", trained / "shards", trained / "shards", progress=False)
    assert not (tmp_path / "x").exists()
