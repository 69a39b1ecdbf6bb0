"""The shard stage's plan (unit tier): blocks cover every record once, in the global order; URL inputs without
their fsspec backend are one line naming the extra."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dipaco.config import resolve
from dipaco.shard_config import ShardConfig
from dipaco.errors import DipacoError
from dipaco.sharding.plan import Block, block_rows, largest_first, make_plan
from dipaco.sharding.sources import iter_rows


def _cfg(block_bytes: int) -> ShardConfig:
    return resolve(ShardConfig, overrides=[f"data.block_bytes={block_bytes}"])


@pytest.mark.parametrize("block_bytes", [1, 7, 50, 333, 10_000])
def test_blocks_cover_every_record_once_in_order(tmp_path, block_bytes):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"text": f"document {i} " + "x" * (i * 7 % 90), "domain": str(i % 3)} for i in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:40]) + "\n")  # a blank last line
    (tmp_path / "b.jsonl").write_text(json.dumps(rows[40]))  # one record, no newline at its end
    pq.write_table(pa.Table.from_pylist(rows[41:]), tmp_path / "c.parquet", row_group_size=4)
    blocks = make_plan([str(tmp_path)], _cfg(block_bytes))
    got = [row for b in blocks for row in block_rows(b, _cfg(block_bytes))]
    assert got == list(iter_rows([str(tmp_path)])) == [(r["text"], r["domain"]) for r in rows]
    ranges = [b for b in blocks if b.source.endswith("a.jsonl")]
    assert (len(ranges) > 1) == (block_bytes < 3000)
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:]))  # contiguous, newline-aligned
    assert [b.index for b in blocks] == list(range(len(blocks)))


def test_a_json_array_file_is_one_block(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": f"doc {i}"} for i in range(50)]))
    assert len(make_plan([str(tmp_path / "a.json")], _cfg(10))) == 1


def test_url_without_its_backend_is_one_line_naming_the_extra():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    with pytest.raises(DipacoError) as err:
        make_plan(["gs://some-bucket/corpus/"], _cfg(1 << 20))
    assert "pip install 'dipaco[gcs]'" in str(err.value) and "\n" not in str(err.value)


def test_a_saved_dataset_is_cut_into_row_ranges(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"text": f"saved document {i} " + "y" * (i % 50), "domain": "d"} for i in range(300)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    cfg = _cfg(2000)
    blocks = make_plan([str(tmp_path / "saved")], cfg)
    assert len(blocks) > 3 and all(b.fmt == "saved" for b in blocks)
    assert [row for b in blocks for row in block_rows(b, cfg)] == [(r["text"], r["domain"]) for r in rows]


def test_engine_ray_without_ray_is_one_line(monkeypatch):
    import sys

    from dipaco.sharding.engines import make_engine

    for name in ("ray", "dipaco.taskqueue.ray_tasks", "dipaco.taskqueue.ray_cluster"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the ray extra were not installed
    with pytest.raises(DipacoError) as err:
        make_engine("ray", 2, "", 4)
    assert "pip install -e '.[ray]'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DipacoError) as err:
        make_engine("local", 2, "10.0.0.5:6379", 4)
    assert "--engine ray" in str(err.value)


def test_blocks_know_their_size_and_the_largest_start_first(tmp_path):
    """Engines start blocks largest first (small ones fill the end of a pass); sizes come from the plan."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " + "z" * 40}) + "\n" for i in range(100)))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one small document"}) + "\n")
    blocks = make_plan([str(tmp_path)], _cfg(1000))
    ranges = [b for b in blocks if b.source.endswith("a.jsonl")]
    assert len(ranges) > 3 and all(b.nbytes == b.end - b.start for b in ranges)
    assert sum(b.nbytes for b in ranges) == (tmp_path / "a.jsonl").stat().st_size
    assert blocks[-1].nbytes == (tmp_path / "b.jsonl").stat().st_size
    order = largest_first(blocks)
    assert sorted(order) == list(range(len(blocks))) and order[-1] == len(blocks) - 1
    assert [blocks[i].nbytes for i in order] == sorted((b.nbytes for b in blocks), reverse=True)
    assert replace(blocks[0], nbytes=0).fingerprint("s") == blocks[0].fingerprint("s")  # derived: not what is read
    assert replace(blocks[0], end=blocks[0].end - 1).fingerprint("s") != blocks[0].fingerprint("s")
    hub = Block(len(blocks), "hub", "some/dataset")  # streamed whole: size unknown, started first
    assert largest_first(blocks + [hub])[0] == hub.index


def test_a_pool_starts_tasks_in_the_given_order_and_returns_them_in_block_order(tmp_path):
    from dipaco.sharding.engines import LocalPool

    pool = LocalPool(1, progress=False)
    try:
        log = tmp_path / "started"
        got = pool.run(_log_and_return, [(str(log), i) for i in range(4)], order=[2, 0, 3, 1])
    finally:
        pool.close()
    assert got == [0, 10, 20, 30] and log.read_text().split() == ["2", "0", "3", "1"]


def _log_and_return(log: str, i: int) -> int:
    with open(log, "a") as fh:
        fh.write(f"{i}\n")
    return 10 * i
