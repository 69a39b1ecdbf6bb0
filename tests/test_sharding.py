import json

import numpy as np
import pytest

from dipaco.errors import DipacoError
from dipaco.routing import Router
from dipaco.sharding.tokenizer import encode, load_tokenizer, train_tokenizer
from dipaco.sharding.writer import shard
from dipaco.storage.shards import ShardSet

from conftest import shard_config


def test_tokenizer_save_load_round_trip(tmp_path):
    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog. " * 5, "ünïcödé ✓ text"]
    tok = train_tokenizer(texts * 20, vocab_size=300)
    tok.save_pretrained(str(tmp_path / "tok"))
    back = load_tokenizer(tmp_path / "tok")
    for t in texts:
        ids = encode(back, [t])[0]
        assert ids == encode(tok, [t])[0]
        assert back.decode(ids) == t  # byte-level: lossless
    assert back.eos_token == "<|endoftext|>"


@pytest.mark.slow
def test_every_document_lands_in_exactly_one_path(shards_2x2, corpus_file):
    s = ShardSet(shards_2x2)
    m = s.manifest
    assert s.grid == "2x2" and s.paths == ["0-0", "0-1", "1-0", "1-1"]
    docs = sum(p["train_docs"] + p["val_docs"] for p in m["paths"].values())
    assert docs == m["train_documents"]
    assert m["train_documents"] + m["heldout_documents"] + m["router_documents"] == m["documents"]
    tok = s.tokenizer()
    for p in s.paths:
        for split in ("train", "val"):
            tokens, offsets = s.tokens(p, split), s.doc_offsets(p, split)
            assert offsets[0] == 0 and offsets[-1] == len(tokens) == m["paths"][p][f"{split}_tokens"]
            assert len(offsets) - 1 == m["paths"][p][f"{split}_docs"]
            if len(offsets) > 1:  # every document ends with EOS
                assert (tokens[offsets[1:] - 1] == tok.eos_token_id).all()
    # the held-out documents are whole and none is trained on
    heldout = {d["text"] for d in s.heldout()}
    assert len(heldout) == m["heldout_documents"]
    first_train = tok.decode(np.asarray(s.tokens("0-0")[: s.doc_offsets("0-0")[1] - 1]).tolist())
    assert first_train not in heldout


@pytest.mark.slow
def test_router_from_python_api(shards_2x2):
    router = Router.load(shards_2x2 / "router")
    docs = ShardSet(shards_2x2).heldout()[:5]
    assert router.route([d["text"] for d in docs]) == [d["path"] for d in docs]


@pytest.mark.slow
def test_deterministic_shards(corpus_file, tmp_path, shards_2x2):
    again = tmp_path / "again"
    shard([str(corpus_file)], shard_config("2x2"), again, progress=False)
    for f in sorted(p.relative_to(shards_2x2) for p in shards_2x2.rglob("*") if p.is_file()):
        if f.name != "manifest.json":
            assert (again / f).read_bytes() == (shards_2x2 / f).read_bytes(), f
    assert json.loads((again / "manifest.json").read_text())["fingerprint"] == ShardSet(shards_2x2).fingerprint


@pytest.mark.slow
def test_bad_inputs_get_clear_errors_and_leave_nothing(tmp_path, corpus_file):
    out = tmp_path / "out"
    with pytest.raises(DipacoError, match="does not exist"):
        shard([str(tmp_path / "missing.jsonl")], shard_config("2"), out, progress=False)
    with pytest.raises(DipacoError, match="no column 'body'"):
        shard([str(corpus_file)], shard_config("2", 'data.text_column="body"'), out, progress=False)
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "x" * 100}) + "\n")
    with pytest.raises(DipacoError, match="cannot fill"):
        shard([str(tiny)], shard_config("2x2"), out, progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "short"}) + "\n")
    with pytest.raises(DipacoError, match="no usable documents"):
        shard([str(empty)], shard_config("2"), out, progress=False)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.tmp*"))


@pytest.mark.slow
def test_existing_output_is_kept(shards_2x2, corpus_file):
    before = (shards_2x2 / "manifest.json").read_bytes()
    with pytest.raises(DipacoError, match="already exists"):
        shard([str(corpus_file)], shard_config("2x2"), shards_2x2, progress=False)
    assert (shards_2x2 / "manifest.json").read_bytes() == before


@pytest.mark.slow
def test_capped_heldout_set_is_drawn_from_the_whole_corpus(tmp_path, corpus_file):
    # The corpus file is sorted by label; a cap that the first label alone would fill must still
    # leave held-out documents of every label (a uniform subset of the candidates, not the first ones).
    rows = [json.loads(l) for l in corpus_file.read_text().splitlines()]
    rows.sort(key=lambda r: r["domain"])
    data = tmp_path / "sorted.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = shard_config("2x2", "data.heldout_fraction=0.4", "data.max_heldout_docs=12", "data.router_fraction=0.0")
    out = tmp_path / "s"
    m = shard([str(data)], cfg, out, progress=False)
    assert m["heldout_documents"] == 12
    assert m["train_documents"] + m["heldout_documents"] + m["router_documents"] == m["documents"]
    held = [json.loads(l) for l in (out / "heldout" / "docs.jsonl").read_text().splitlines()]
    where = {r["text"].strip(): i for i, r in reversed(list(enumerate(rows)))}
    positions = [where[d["text"]] / len(rows) for d in held]
    # twelve uniform draws all in one half of the file: probability 1 in 2,000
    assert len(held) == 12 and min(positions) < 0.5 < max(positions), positions
    assert len({d["label"] for d in held}) >= 3
