"""Corpus sources, streamed: local JSON lines / parquet / CSV / text files (optionally .gz; readers.py reads
them) or a hub dataset (through `datasets`, streaming); filters, exact dedup, and the local default corpus.

Nothing here holds the corpus in memory: readers yield one record at a time.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dipaco.errors import DipacoError
from dipaco.io import sha256_dir, sha256_file
from dipaco.sharding.readers import READERS, RemoteFile, missing_column

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
            ".md": "text", ".rst": "text", ".text": "text"}


@dataclass
class Document:
    text: str
    label: str | None = None


def _format_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return _FORMATS.get(suffixes[-1]) if suffixes else None


def saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def expand_inputs(specs: list[str], skipped: list[Path] | None = None) -> tuple[dict[str, list[Path]], list[str]]:
    """Group local files by format (directories are walked; a ``save_to_disk`` directory is format "saved");
    an ``owner/name`` not on disk is a hub name. Files of a walked directory that are not read are appended
    to ``skipped`` when a list is given."""
    by_format: dict[str, list[Path]] = {}
    hub: list[str] = []
    for spec in specs:
        if "://" in spec:  # s3://, gs://, ... through fsspec
            for f in remote_files(spec):
                if _format_of(f):
                    by_format.setdefault(_format_of(f), []).append(f)
                elif skipped is not None:
                    skipped.append(f)
            continue
        path = Path(spec)
        if path.is_dir() and saved_dataset(path):
            by_format.setdefault("saved", []).append(path)
            continue
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            files = [p for p in found if _format_of(p)]
            if skipped is not None:
                skipped.extend(p for p in found if not _format_of(p))
            if not files:
                raise DipacoError(f"input directory {path} holds no .jsonl/.json/.parquet/.csv/.txt files; point --data at the files")
        elif path.is_file():
            files = [path]
            if not _format_of(path):
                raise DipacoError(f"input {path}: unknown file type; use .jsonl, .json, .parquet, .csv or .txt (optionally .gz)")
        elif _looks_like_hub_name(spec) and not Path(spec.split("/")[0]).exists():
            hub.append(spec)
            continue
        else:
            hint = ""
            if _looks_like_hub_name(spec):  # its owner part is a local folder: a mistyped local path
                hint = f" ({spec.split('/')[0]} exists here, so it is not tried as a hub dataset name)"
            raise DipacoError(f"input {spec} does not exist{hint}; pass existing files or directories to --data")
        for f in files:
            if not os.access(f, os.R_OK):
                raise DipacoError(f"input {f} is not readable; fix its permissions")
            by_format.setdefault(_format_of(f), []).append(f)
    return by_format, hub


_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def remote_files(spec: str) -> list[RemoteFile]:
    """The files an fsspec URL names: one object, every object under a prefix, or a glob's matches."""
    import fsspec

    protocol = spec.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(spec)
    except (ImportError, ValueError) as exc:  # fsspec: ImportError for a missing backend, ValueError for an unknown one
        extra = _EXTRAS.get(protocol)
        fix = f"install the {extra} extra: pip install 'dipaco[{extra}]'" if extra else f"install the fsspec backend for {protocol}://"
        raise DipacoError(f"input {spec}: reading {protocol}:// needs a library that is not installed ({exc}); {fix}") from None
    try:
        if glob.has_magic(root):
            found = sorted(fs.glob(root))
        elif fs.isdir(root):
            found = sorted(fs.find(root))
        elif fs.exists(root):
            found = [root]
        else:
            found = []
    except Exception as exc:  # network, credentials, permissions: every backend raises its own types
        raise DipacoError(f"cannot list input {spec} ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                          f"check the URL and your credentials") from None
    if not found:
        raise DipacoError(f"input {spec} does not exist (no object at that URL); pass existing objects or prefixes to --data")
    return [RemoteFile(fs.unstrip_protocol(p)) for p in found]


def _looks_like_hub_name(spec: str) -> bool:
    """``owner/name``. When ``owner`` is a local directory it is a mistyped local path, not tried on the hub
    (that only costs the user half a minute of retries before the same error)."""
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/")) and not Path(spec).suffix


def _rows_hub(name: str, split: str, column: str, label_column: str) -> Iterator[tuple[object, object]]:
    import datasets

    datasets.disable_progress_bars()
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as exc:  # datasets raises many types (offline, no such dataset, bad split)
        raise DipacoError(f"cannot load hub dataset {name} split {split!r}: {str(exc).splitlines()[0][:200]}; "
                          f"check the name and --split, or pass local files") from None
    first = True
    for row in stream:
        if first and column not in row:
            raise missing_column(name, column, row)
        first = False
        yield row.get(column), row.get(label_column)


def load_saved(path: Path, split: str, column: str):
    """The ``split`` of a ``save_to_disk`` directory (``datasets.load_from_disk``: memory-mapped), checked to
    hold ``column``."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a damaged directory
        raise DipacoError(f"cannot load the saved dataset {path} ({str(exc).splitlines()[0][:200]}); "
                          f"save it again with save_to_disk, or write it as JSON lines with to_json") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DipacoError(f"saved dataset {path} has no split {split!r} (splits: {', '.join(ds)}); pass --split")
        ds = ds[split]
    if column not in ds.column_names:
        raise missing_column(path, column, ds.column_names)
    return ds


def _rows_saved(path: Path, split: str, column: str, label_column: str,
                rows: tuple[int, int] | None = None) -> Iterator[tuple[object, object]]:
    """Rows of a ``save_to_disk`` directory, streamed; ``rows``: only rows [start, end)."""
    ds = load_saved(path, split, column)
    cols = [c for c in (column, label_column) if c in ds.column_names]
    if rows is not None:
        ds = ds.select(range(*rows))
    for batch in ds.select_columns(cols).iter(batch_size=1000):
        yield from zip(batch[column], batch.get(label_column) or [None] * len(batch[column]))


def iter_rows(specs: list[str], text_column: str = "text", label_column: str = "domain",
              split: str = "train", stats: dict | None = None) -> Iterator[tuple[object, object]]:
    """(raw text value, raw label value) of every input record, streamed in input order.

    ``stats["invalid_utf8"]`` (when a dict is given) counts records that held invalid UTF-8: they are kept
    with U+FFFD replacement characters; a file where that is most of its records is refused."""
    by_format, hub = expand_inputs(specs)
    for fmt in by_format:
        for f in by_format[fmt]:
            if fmt == "saved":
                yield from _rows_saved(f, split, text_column, label_column)
            else:
                yield from READERS[fmt](f, text_column, label_column, stats)
    for name in hub:
        yield from _rows_hub(name, split, text_column, label_column)


def describe_inputs(specs: list[str], split: str = "train", skipped: list[Path] | None = None) -> list[dict]:
    """Size and content hash of every input file (hub datasets: name and split); files of the input
    directories that are not read (no known extension) are appended to ``skipped``."""
    by_format, hub = expand_inputs(specs, skipped)
    out = [_describe_remote(f) if isinstance(f, RemoteFile) else
           {"path": str(f), "bytes": f.stat().st_size, "sha256": sha256_file(f)} if fmt != "saved" else
           {"path": str(f), "saved_dataset": True, "bytes": sum(p.stat().st_size for p in f.rglob("*") if p.is_file()),
            "sha256": sha256_dir(f)}
           for fmt in by_format for f in by_format[fmt]]
    return out + [{"dataset": name, "split": split} for name in hub]


def _describe_remote(f: RemoteFile) -> dict:
    """An object in a bucket is named by its size and ETag (reading it whole in the driver would cost what
    the stage's workers save)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(f.url)
    info = fs.info(root)
    return {"path": f.url, "bytes": int(info.get("size") or 0),
            "etag": str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or "")}


DROP_REASONS = ("missing_text", "not_text", "binary", "too_short", "duplicate")


class DocumentFilter:
    """Cleans one raw text at a time: strip, drop binary/short/duplicate, cut long ones.

    ``dropped`` counts documents dropped by reason; ``truncated`` counts kept documents that were cut.
    Duplicates are found by a 128-bit hash of the cleaned text (16 bytes per kept document in memory).
    """

    def __init__(self, min_chars: int = 64, max_chars: int = 1_000_000, dedup: bool = True):
        self.min_chars, self.max_chars, self.dedup = min_chars, max_chars, dedup
        self.dropped = {r: 0 for r in DROP_REASONS}
        self.truncated = 0
        self._seen: set[bytes] = set()

    def __call__(self, text) -> str | None:
        if text is None:
            self.dropped["missing_text"] += 1
            return None
        if not isinstance(text, str):  # a number, list, object, ...: the text column holds something else
            self.dropped["not_text"] += 1
            return None
        text = text.strip()
        if "\x00" in text:
            self.dropped["binary"] += 1
            return None
        if len(text) < self.min_chars:
            self.dropped["too_short"] += 1
            return None
        if len(text) > self.max_chars:
            text = text[: self.max_chars]
            self.truncated += 1
        if self.dedup:
            digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=16).digest()
            if digest in self._seen:
                self.dropped["duplicate"] += 1
                return None
            self._seen.add(digest)
        return text

    def report(self) -> dict[str, int]:
        return dict(self.dropped) | {"truncated": self.truncated}


def iter_documents(specs: list[str], text_column: str = "text", label_column: str = "domain", min_chars: int = 64,
                   max_chars: int = 1_000_000, split: str = "train", dedup: bool = True,
                   filt: DocumentFilter | None = None) -> Iterator[Document]:
    """Every usable document of the inputs, streamed in input order (pass ``filt`` to read its drop counts)."""
    filt = filt or DocumentFilter(min_chars, max_chars, dedup)
    for text, label in iter_rows(specs, text_column, label_column, split):
        text = filt(text)
        if text is not None:
            yield Document(text, None if label is None else str(label))


# ------------------------------------------------------------------------------- default corpus
def _read_text_file(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        if b"\x00" in raw[:4096]:
            return None
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def _chunks(text: str, size: int) -> list[str]:
    """Split long text on blank lines into pieces of about ``size`` characters."""
    if len(text) <= size:
        return [text]
    out, current = [], []
    length = 0
    for para in text.split("\n\n"):
        if length + len(para) > size and current:
            out.append("\n\n".join(current))
            current, length = [], 0
        current.append(para)
        length += len(para) + 2
    if current:
        out.append("\n\n".join(current))
    return out


def _take(files: list[Path], budget: int, chunk: int, spread: int = 400) -> list[str]:
    """Documents from ``files`` until ``budget`` characters, visiting ~``spread`` evenly spaced files first
    so that the sample covers the whole tree, not its alphabetical start."""
    step = max(1, len(files) // spread)
    order = files[::step] + [f for i, f in enumerate(files) if i % step]
    docs, total = [], 0
    for f in order:
        if total >= budget:
            break
        text = _read_text_file(f)
        for piece in _chunks(text or "", chunk):
            if len(piece.strip()) >= 200:
                docs.append(piece.strip())
                total += len(piece)
    return docs


def default_corpus_documents(budget_per_kind: int = 1_500_000, chunk: int = 6000) -> list[Document]:
    """Text that any machine with Python has (plus common Unix files where present), labelled by kind."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    kinds: dict[str, list[str]] = {}
    code = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
                  and "idlelib" not in p.parts)
    kinds["python-code"] = _take(code, budget_per_kind, chunk)
    try:
        from pydoc_data.topics import topics

        kinds["python-docs"] = [t.strip() for _, t in sorted(topics.items()) if len(t.strip()) >= 200]
    except ImportError:
        pass
    licenses = sorted(Path("/usr/share/common-licenses").glob("*")) + sorted(
        Path(p) for p in glob.glob("/usr/share/doc/*/copyright"))
    kinds["licenses"] = _take([p for p in licenses if p.is_file()], budget_per_kind, chunk)
    headers = sorted(Path(p) for p in glob.glob("/usr/include/**/*.h", recursive=True))
    kinds["c-headers"] = _take(headers, budget_per_kind, chunk)
    return [Document(text, kind) for kind, texts in kinds.items() for text in texts]


def write_default_corpus(path: str | Path, budget_per_kind: int = 1_500_000) -> dict[str, int]:
    """Write the default corpus as JSON lines {"text", "domain", "source"}; return documents per kind."""
    docs = default_corpus_documents(budget_per_kind)
    counts: dict[str, int] = {}
    for d in docs:
        counts[d.label] = counts.get(d.label, 0) + 1
    if len([k for k, n in counts.items() if n >= 20]) < 2:
        raise DipacoError(f"found too little local text for the default corpus ({counts}); pass your own --data")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d.text, "domain": d.label, "source": "local"}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return counts
