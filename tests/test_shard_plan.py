"""The shard stage's plan (unit tier): blocks cover every record once, in the global order; URL inputs without
their fsspec backend are one line naming the extra."""

from __future__ import annotations

import json

import pytest

from dipaco.config import resolve
from dipaco.shard_config import ShardConfig
from dipaco.errors import DipacoError
from dipaco.sharding.plan import block_rows, make_plan
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
