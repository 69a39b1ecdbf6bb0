"""The shard stage's plan: the corpus cut into blocks, in one global order, each a unit of work any worker can take.

The global order is the order in which one process reads the inputs (``sources.iter_rows``): inputs by format
in order of first appearance, files in order, records in file order, hub datasets last. A block is

  a whole file                     CSV, plain text, gzipped files, a JSON array
  a newline-aligned byte range     of a JSON-lines file larger than ``data.block_bytes`` (so one big file is
                                   read by many workers; every line belongs to the range it starts in)
  a run of parquet row groups      about ``data.block_bytes`` of uncompressed data, at least one group
  a range of rows                  of a ``save_to_disk`` dataset
  a whole hub dataset              (streamed: it cannot be cut without reading it)

A block's fingerprint names what it reads (source, range, the source's size and modification stamp or ETag)
and the stage's settings (the config but for how many threads or workers run it, the seed, dipaco's
version). A part made from the block under another fingerprint is not reused by ``--resume``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import dipaco
from dipaco.config import to_dict
from dipaco.shard_config import ShardConfig
from dipaco.errors import DipacoError
from dipaco.sharding.readers import READERS, RemoteFile, open_binary
from dipaco.sharding.sources import _rows_hub, _rows_saved, expand_inputs, load_saved

ALIGN_READ = 1 << 16  # bytes read at a time while looking for the newline that ends a range


@dataclass(frozen=True)
class Block:
    index: int
    fmt: str  # json, csv, parquet, text, saved, hub
    source: str  # local path, fsspec URL, or hub dataset name
    start: int = 0  # json: first byte; parquet: first row group; saved: first row
    end: int = -1  # exclusive; -1: to the end
    identity: str = ""  # size and modification stamp (or ETag) of the source when planned
    nbytes: int = -1  # about how many bytes it reads (-1: unknown, a streamed hub dataset): the engines start big blocks first

    @property
    def name(self) -> str:
        return f"{self.index:06d}"

    def describe(self) -> str:
        unit = {"json": "bytes", "parquet": "row groups", "saved": "rows"}.get(self.fmt)
        return self.source + (f" ({unit} {self.start}-{self.end})" if unit and (self.start or self.end >= 0) else "")

    def fingerprint(self, settings: str) -> str:
        # nbytes follows from the range and the source's identity, so it adds nothing to what identifies the block
        what = {k: v for k, v in asdict(self).items() if k != "nbytes"}
        return hashlib.sha256(json.dumps([what, settings], sort_keys=True).encode()).hexdigest()


def settings_key(cfg: ShardConfig, tokenizer_sha256: str | None = None) -> str:
    """What decides the bytes besides the inputs: the config (not its thread count), a given tokenizer, the version."""
    config = to_dict(cfg)
    config.pop("num_proc", None)
    blob = json.dumps([config, tokenizer_sha256, dipaco.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _source(f) -> str:
    return str(f)


def _identity(f) -> tuple[int, str]:
    """(size, stamp) of a local file or an fsspec URL."""
    if isinstance(f, RemoteFile):
        import fsspec

        fs, root = fsspec.core.url_to_fs(f.url)
        info = fs.info(root)
        stamp = info.get("ETag") or info.get("etag") or info.get("md5Hash") or str(info.get("LastModified") or info.get("mtime"))
        return int(info.get("size") or 0), str(stamp)
    st = Path(f).stat()
    return st.st_size, str(st.st_mtime_ns)


def make_plan(specs: list[str], cfg: ShardConfig) -> list[Block]:
    """Every block of the inputs, in the global order."""
    by_format, hub = expand_inputs(specs)
    blocks: list[Block] = []

    def add(fmt, source, start=0, end=-1, identity="", nbytes=-1):
        blocks.append(Block(len(blocks), fmt, source, start, end, identity, nbytes))

    for fmt, files in by_format.items():
        for f in files:
            if fmt == "saved":
                for start, end, stamp, nbytes in _saved_ranges(Path(f), cfg):
                    add(fmt, str(f), start, end, stamp, nbytes)
                continue
            size, stamp = _identity(f)
            ident = f"{size}:{stamp}"
            if fmt == "json" and size > cfg.data.block_bytes and f.suffix.lower() != ".gz" and not _is_array(f):
                cuts = _newline_cuts(f, size, cfg.data.block_bytes)
                for start, end in zip(cuts, cuts[1:]):
                    add(fmt, _source(f), start, end, ident, end - start)
            elif fmt == "parquet":
                for start, end, nbytes in _row_group_runs(f, cfg.data.block_bytes):
                    add(fmt, _source(f), start, end, ident, nbytes)
            else:
                add(fmt, _source(f), identity=ident, nbytes=size)
    for name in hub:
        add("hub", name, identity=cfg.data.split)
    return blocks


def largest_first(blocks: list[Block]) -> list[int]:
    """The order in which the engines start the blocks: the largest first (unknown sizes before all), so the
    small ones fill the end of a pass and no worker is left alone on a big last block while the others idle.
    The results do not depend
    on it: the merge takes the parts in block order."""
    return sorted(range(len(blocks)), key=lambda i: (blocks[i].nbytes >= 0, -blocks[i].nbytes, i))


def _is_array(f) -> bool:
    with open_binary(f) as fh:
        head = fh.read(256).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"[")


def _newline_cuts(f, size: int, block: int) -> list[int]:
    """0, the first line start at or after each multiple of ``block``, and ``size`` (no empty ranges)."""
    cuts = [0]
    with open_binary(f) as fh:
        for target in range(block, size, block):
            if target <= cuts[-1]:
                continue
            fh.seek(target - 1)  # a line starts at target if the byte before it is a newline
            pos = target - 1
            while True:
                chunk = fh.read(ALIGN_READ)
                if not chunk:
                    pos = size
                    break
                nl = chunk.find(b"\n")
                if nl >= 0:
                    pos += nl + 1
                    break
                pos += len(chunk)
            if cuts[-1] < pos < size:
                cuts.append(pos)
    return cuts + [size]


def _row_group_runs(f, block: int) -> list[tuple[int, int, int]]:
    """(first, end, uncompressed bytes) of each run of row groups."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(open_binary(f) if isinstance(f, RemoteFile) else f).metadata
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DipacoError(f"cannot read {f} as parquet ({str(exc).splitlines()[0][:200]}); fix or remove the bad file") from None
    runs, start, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= block:
            runs.append((start, g + 1, size))
            start, size = g + 1, 0
    if start < meta.num_row_groups or not runs:
        runs.append((start, meta.num_row_groups, size))
    return runs


def _saved_ranges(path: Path, cfg: ShardConfig) -> list[tuple[int, int, str, int]]:
    ds = load_saved(path, cfg.data.split, cfg.data.text_column)
    rows, nbytes = ds.num_rows, max(1, ds.data.nbytes)
    step = max(1, rows * cfg.data.block_bytes // nbytes)
    stamp = f"{rows}:{ds._fingerprint}"
    return [(a, min(rows, a + step), stamp, (min(rows, a + step) - a) * nbytes // rows)
            for a in range(0, rows, step)] or [(0, 0, stamp, 0)]


def block_rows(block: Block, cfg: ShardConfig, stats: dict | None = None) -> Iterator[tuple[object, object]]:
    """(raw text value, raw label value) of every record of ``block``, in order."""
    d = cfg.data
    source = RemoteFile(block.source) if "://" in block.source else Path(block.source)
    if block.fmt == "hub":
        yield from _rows_hub(block.source, d.split, d.text_column, d.label_column)
    elif block.fmt == "saved":
        yield from _rows_saved(source, d.split, d.text_column, d.label_column, rows=(block.start, block.end))
    elif block.fmt == "json" and block.end >= 0:
        yield from READERS["json"](source, d.text_column, d.label_column, stats, block.start, block.end)
    elif block.fmt == "parquet" and block.end >= 0:
        yield from READERS["parquet"](source, d.text_column, d.label_column, stats, list(range(block.start, block.end)))
    else:
        yield from READERS[block.fmt](source, d.text_column, d.label_column, stats)
