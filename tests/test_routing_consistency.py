"""One routing function from shard to answer: the shard stage, eval, generate and reshard route a document
by the same input (its decoded first 32 tokens) through the same frozen router; the i.i.d. control; paths
defined on whole documents and learned back from the prefix; the window router of every-W routing."""

import json

import numpy as np
import pytest

from dipaco.errors import DipacoError
from dipaco.eval.documents import heldout_tokens, route_documents, shard_router, validation_tokens
from dipaco.eval.perplexity import evaluate
from dipaco.routing import Router
from dipaco.sharding.writer import shard
from dipaco.storage.run import Run
from dipaco.storage.shards import ShardSet

from conftest import shard_config
from eval_helpers import private_run

pytestmark = pytest.mark.slow  # real shards and runs


def _texts(path):
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


def test_shard_and_eval_route_every_document_the_same_way(shards_2x2, tmp_path_factory):
    s = ShardSet(shards_2x2)
    m = s.manifest
    agree = m["route_agreement"]
    assert agree["heldout"] == 1.0 and agree["heldout_documents"] == m["heldout_documents"] > 0
    assert 0 < m["purity"]["train"] <= 1 and 0 < m["purity"]["heldout"] <= 1
    # what eval does (held-out documents cut to a run's max tokens, routed from their ids) gives the
    # path the shard stage wrote
    run = Run(private_run(tmp_path_factory, shards_2x2))
    docs, ids = heldout_tokens(s, run.config.eval.max_tokens_per_doc)
    assert route_documents(run, shard_router(s, 32), ids) == [d["path"] for d in docs]
    # validation documents, read back from their tokens, route to the path they are stored in
    val_docs, val_ids = validation_tokens(s, 10_000)
    assert len(val_docs) == sum(p["val_docs"] for p in m["paths"].values())
    routed = shard_router(s, 32).route_ids(val_ids)
    assert routed == [d["path"] for d in val_docs]  # --balance moves no document off its routed path
    # the router reads the first 32 tokens and nothing else
    router = Router.load(shards_2x2 / "router")
    text = _texts(shards_2x2 / "heldout" / "docs.jsonl")[0]
    assert router.route([text]) == router.route([text + " completely different words " * 50])
    with pytest.raises(DipacoError, match="context_tokens >= 32"):
        shard_router(s, 16)


def test_random_assignment_is_an_iid_control_with_the_same_split(corpus_file, shards_2x2, tmp_path):
    out = tmp_path / "random"
    m = shard([str(corpus_file)], shard_config("2x2", 'routing.assign="random"'), out, progress=False)
    ref = ShardSet(shards_2x2).manifest
    assert m["tokenizer"]["sha256"] == ref["tokenizer"]["sha256"]  # same seed: same sample, same tokenizer
    assert _texts(out / "heldout" / "docs.jsonl") == _texts(shards_2x2 / "heldout" / "docs.jsonl")
    assert (out / "router_docs" / "docs.jsonl").read_text() .count("\n") == ref["router_documents"]
    assert [json.loads(l)["text"] for l in (out / "router_docs" / "docs.jsonl").read_text().splitlines()] == \
        [json.loads(l)["text"] for l in (shards_2x2 / "router_docs" / "docs.jsonl").read_text().splitlines()]
    assert sum(p["val_docs"] for p in m["paths"].values()) == sum(p["val_docs"] for p in ref["paths"].values())
    sizes = [p["train_docs"] + p["val_docs"] for p in m["paths"].values()]
    assert min(sizes) > 0.6 * np.mean(sizes)  # uniform, not clustered
    assert m["purity"]["train"] < ref["purity"]["train"]  # paths mix the domains
    assert m["router"]["kind"] == "random" and m["route_agreement"]["heldout"] == 1.0
    router = Router.load(out / "router")
    docs = ShardSet(out).heldout()
    assert router.route([d["text"] for d in docs]) == [d["path"] for d in docs]
    with pytest.raises(DipacoError, match="assign"):
        shard([str(corpus_file)], shard_config("2x2", 'routing.assign="hash"'), tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()


def test_document_clusters_learned_from_the_prefix(corpus_file, shards_2x2, tmp_path):
    cfg = shard_config("2x2", 'routing.cluster_on="document"')
    m = shard([str(corpus_file)], cfg, tmp_path / "doc", tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    router = m["router"]
    assert router["kind"] == "discriminative" and router["target"] == "document k-means"
    assert 0.5 < router["target_agreement_on_fit_sample"] <= 1.0
    assert m["route_agreement"]["heldout"] == 1.0  # the classifier that sharded is the one that answers
    assert m["assignment"]["shares"]["within_cap"]  # its offsets keep the --balance cap (1.2) on the corpus
    assert min(p["train_docs"] for p in m["paths"].values()) > 0


def test_eval_on_validation_documents(shards_2x2, tmp_path_factory):
    run_dir = private_run(tmp_path_factory, shards_2x2)
    rep = evaluate({"d": run_dir}, shards_2x2, progress=False, split="val", oracle=True)
    assert rep["split"] == "val" and rep["heldout_documents"] is None
    assert rep["documents"] == sum(p["val_docs"] for p in ShardSet(shards_2x2).manifest["paths"].values())
    assert rep["methods"]["d oracle"]["perplexity"] <= rep["methods"]["d"]["perplexity"]
    with pytest.raises(DipacoError, match="split"):
        evaluate({"d": run_dir}, shards_2x2, progress=False, split="test")
