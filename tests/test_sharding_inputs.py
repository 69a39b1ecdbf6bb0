"""Input formats, filters and dedup of the streaming shard stage; manifest contents; inspect."""

import csv
import gzip
import json
import types

import numpy as np
import pytest

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.sharding.sources import iter_documents, iter_rows
from dipaco.sharding.writer import shard
from dipaco.storage.shards import ShardSet

from conftest import shard_config


@pytest.fixture(scope="module")
def rows(corpus_file):
    return [json.loads(line) for line in open(corpus_file, encoding="utf-8")]


def _write_all_formats(rows, root):
    """The same documents split over .jsonl.gz, parquet, csv and a directory of .txt files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    quarter = len(rows) // 4
    parts = [rows[:quarter], rows[quarter:2 * quarter], rows[2 * quarter:3 * quarter], rows[3 * quarter:]]
    with gzip.open(root / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        for r in parts[0]:
            f.write(json.dumps({"body": r["text"], "domain": r["domain"]}) + "\n")
    pq.write_table(pa.table({"body": [r["text"] for r in parts[1]], "domain": [r["domain"] for r in parts[1]]}), root / "b.parquet")
    with open(root / "c.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["body", "domain"])
        w.writeheader()
        for r in parts[2]:
            w.writerow({"body": r["text"], "domain": r["domain"]})
    (root / "txt").mkdir()
    for i, r in enumerate(parts[3]):
        (root / "txt" / f"{i:04d}.txt").write_text(r["text"], encoding="utf-8")
    return parts


@pytest.mark.slow
def test_every_format_streams_the_same_documents(rows, tmp_path):
    parts = _write_all_formats(rows, tmp_path / "in")
    stream = iter_documents([str(tmp_path / "in" / n) for n in ("a.jsonl.gz", "b.parquet", "c.csv", "txt")],
                            text_column="body", min_chars=0, dedup=False)
    assert isinstance(stream, types.GeneratorType)  # lazy: nothing is read before it is asked for
    docs = list(stream)
    assert [d.text for d in docs] == [r["text"].strip() for part in parts for r in part]
    assert [d.label for d in docs[: len(parts[0])]] == [r["domain"] for r in parts[0]]


@pytest.mark.slow
def test_filters_dedup_and_manifest(rows, tmp_path, shards_2x2):
    src = tmp_path / "c.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"text": r["text"], "domain": r["domain"]}) + "\n")
        for r in rows[:7]:  # exact duplicates (after stripping)
            f.write(json.dumps({"text": "  " + r["text"] + "\n", "domain": r["domain"]}) + "\n")
        f.write(json.dumps({"text": "too short"}) + "\n")
        f.write(json.dumps({"text": "bin\x00ary" * 20}) + "\n")
        f.write(json.dumps({"other": 1}) + "\n")
        f.write(json.dumps({"text": "y" * 5000}) + "\n")
    cfg = shard_config("2", "data.max_chars=4000", "data.router_fraction=0.1")
    m = shard([str(src)], cfg, tmp_path / "s", tokenizer_dir=str(shards_2x2 / "tokenizer"), progress=False)
    unique = len({r["text"].strip()[:4000] for r in rows})
    assert m["dropped"] == {"missing_text": 1, "not_text": 0, "binary": 1, "too_short": 1, "duplicate": len(rows) - unique + 7}
    assert m["truncated"] >= 1 and m["documents"] == unique + 1
    assert m["router_documents"] > 0 and (tmp_path / "s" / "router_docs" / "docs.jsonl").is_file()
    assert m["inputs"][0]["sha256"] and m["inputs"][0]["bytes"] == src.stat().st_size
    assert m["router"]["features"]["kind"] == "tfidf" and m["config"]["routing"]["balance"] == 1.2
    assert sum(p["train_tokens"] + p["val_tokens"] for p in m["paths"].values()) == m["tokens"]
    assert {"scan", "tokenizer", "router", "write"} <= set(m["timing"])


def test_bad_rows_get_one_line_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x" * 100}) + "\n{not json\n")
    with pytest.raises(DipacoError, match=r"line 2 as JSON"):
        list(iter_rows([str(bad)]))
    nocol = tmp_path / "n.csv"
    nocol.write_text("a,b\n1,2\n")
    with pytest.raises(DipacoError, match="no column 'text'"):
        list(iter_rows([str(nocol)]))
    out = tmp_path / "out"
    assert main(["shard", "--data", str(bad), "--out", str(out), "--grid", "2", "--quiet"]) == 2
    assert not out.exists() and not list(tmp_path.glob(".out.tmp*"))


@pytest.mark.slow
def test_inspect_cli(shards_2x2, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # without --png nothing is written, here or anywhere
    assert main(["inspect", str(shards_2x2)]) == 0
    assert "no plot written; add --png" in capsys.readouterr().out and not any(tmp_path.iterdir())
    png = tmp_path / "sizes.png"
    assert main(["inspect", str(shards_2x2), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 1000 and f"wrote {png} (the plot of path sizes)" in out
    for p in ShardSet(shards_2x2).paths:
        assert f"| {p} |" in out
    assert "path sizes" in out
    assert main(["inspect", str(shards_2x2), "--png", str(png), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert all(r["terms"] and r["openings"] for r in summary["paths"])
