"""lm and encoder routing features from tiny local Hugging Face models that the tests build themselves."""

import json

import numpy as np
import pytest

from dipaco.errors import DipacoError
from dipaco.routing import Router, fit_router
from dipaco.sharding.writer import shard
from dipaco.storage.shards import ShardSet

from conftest import shard_config

pytestmark = pytest.mark.slow  # real shards, tiny HF models


@pytest.fixture(scope="module")
def texts(corpus_file):
    return [json.loads(line)["text"] for line in open(corpus_file, encoding="utf-8")][:120]


def _tokenizer(shards_2x2):
    from dipaco.sharding.tokenizer import load_tokenizer

    return load_tokenizer(shards_2x2 / "tokenizer")


@pytest.fixture(scope="module")
def tiny_lm(shards_2x2, tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer(shards_2x2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    out = tmp_path_factory.mktemp("models") / "tiny-lm"
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_encoder(shards_2x2, tmp_path_factory):
    import torch
    from transformers import BertConfig, BertModel

    tok = _tokenizer(shards_2x2)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=64, pad_token_id=tok.eos_token_id)
    out = tmp_path_factory.mktemp("models") / "tiny-encoder"
    BertModel(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["lm", "encoder"])
def test_model_features_route_the_same_after_load(kind, tiny_lm, tiny_encoder, texts, tmp_path, tok):
    model_dir = tiny_lm if kind == "lm" else tiny_encoder
    router = fit_router(texts, "2x2", tok, features=kind, feature_model=str(model_dir), seed=0)
    x = router.features.transform(texts[:8])
    assert x.shape == (8, 32) and np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    # only the first 32 tokens matter: a different continuation gives the same features
    long = texts[0] + " continuation " * 200
    assert np.allclose(router.features.transform([long]), router.features.transform([long[:400] + " other tail"]), atol=1e-5)
    routes = router.route(texts)
    router.save(tmp_path / "router")
    assert (tmp_path / "router" / "features" / "model" / "model.safetensors").is_file()  # frozen copy
    assert not list((tmp_path / "router").rglob("*.bin"))
    loaded = Router.load(tmp_path / "router")
    assert loaded.route(texts) == routes
    assert [p for p, _ in loaded.route_topk(texts[:3], 2)[0]][0] == routes[0]


def test_referenced_model_is_hash_checked(tiny_lm, texts, tmp_path, tok):
    import shutil

    model = tmp_path / "lm"
    shutil.copytree(tiny_lm, model)
    router = fit_router(texts[:40], "2", tok, features="lm", feature_model=str(model), copy_feature_model=False)
    router.save(tmp_path / "router")
    assert not (tmp_path / "router" / "features" / "model").exists()
    assert Router.load(tmp_path / "router").route(texts[:5]) == router.route(texts[:5])
    (model / "config.json").write_text((model / "config.json").read_text().replace('"hidden_act"', '"hidden_act" ', 1))
    with pytest.raises(DipacoError, match="changed since the router was built"):
        Router.load(tmp_path / "router")


def test_bad_feature_model_errors(tmp_path, texts, tok):
    with pytest.raises(DipacoError, match="not a Hugging Face model directory"):
        fit_router(texts[:20], "2", tok, features="lm", feature_model=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DipacoError, match="no .safetensors"):
        fit_router(texts[:20], "2", tok, features="encoder", feature_model=str(tmp_path))
    with pytest.raises(DipacoError, match="need a model"):
        fit_router(texts[:20], "2", tok, features="lm")


def test_shard_with_lm_features(tiny_lm, corpus_file, shards_2x2, tmp_path):
    cfg = shard_config("2", 'routing.features="lm"', f'routing.feature_model="{tiny_lm}"', "routing.balance=0.0")
    m = shard([str(corpus_file)], cfg, tmp_path / "s", tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    assert m["router"]["features"]["kind"] == "lm" and m["router"]["features"]["model_copied"]
    s = ShardSet(tmp_path / "s")
    docs = s.heldout()
    assert Router.load(tmp_path / "s" / "router").route([d["text"] for d in docs]) == [d["path"] for d in docs]
    assert sum(p["train_docs"] + p["val_docs"] for p in m["paths"].values()) == m["train_documents"]
