"""Corpus sources: local files or a hub dataset through `datasets`, filters, dedup, the default corpus."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.io import sha256_file

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
            ".md": "text", ".rst": "text", ".text": "text"}


@dataclass
class Document:
    text: str
    label: str | None = None


@dataclass
class Corpus:
    documents: list[Document]
    dropped: dict[str, int] = field(default_factory=dict)
    inputs: list[dict] = field(default_factory=list)


def _format_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return _FORMATS.get(suffixes[-1]) if suffixes else None


def expand_inputs(specs: list[str]) -> tuple[dict[str, list[Path]], list[str]]:
    """Group local files by format (directories are walked); anything not on disk is a hub name."""
    by_format: dict[str, list[Path]] = {}
    hub: list[str] = []
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p))
            if not files:
                raise DipacoError(f"input directory {path} holds no .jsonl/.json/.parquet/.csv/.txt files; point --data at the files")
        elif path.is_file():
            files = [path]
            if not _format_of(path):
                raise DipacoError(f"input {path}: unknown file type; use .jsonl, .json, .parquet, .csv or .txt (optionally .gz)")
        elif "/" in spec and not spec.startswith((".", "/")) and len(spec.split("/")) == 2 and not path.suffix:
            hub.append(spec)
            continue
        else:
            raise DipacoError(f"input {spec} does not exist; pass existing files or directories to --data")
        for f in files:
            if not os.access(f, os.R_OK):
                raise DipacoError(f"input {f} is not readable; fix its permissions")
            by_format.setdefault(_format_of(f), []).append(f)
    return by_format, hub


def _load(fmt_or_name: str, data_files=None, split: str = "train"):
    import datasets
    from datasets.exceptions import DatasetGenerationError

    datasets.disable_progress_bars()
    try:
        if data_files is None:
            return datasets.load_dataset(fmt_or_name, split=split)
        kwargs = {"sample_by": "document"} if fmt_or_name == "text" else {}
        return datasets.load_dataset(fmt_or_name, data_files=[str(f) for f in data_files], split="train", **kwargs)
    except DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        files = ", ".join(str(f) for f in (data_files or [fmt_or_name]))
        raise DipacoError(f"cannot read {files} as {fmt_or_name}: {str(cause).splitlines()[0][:200]}; fix or remove the bad file") from None
    except (FileNotFoundError, ConnectionError, ValueError) as exc:
        raise DipacoError(f"cannot load {fmt_or_name}: {str(exc).splitlines()[0][:200]}") from None


def read_corpus(specs: list[str], text_column: str = "text", label_column: str = "domain", min_chars: int = 64,
                max_chars: int = 1_000_000, split: str = "train") -> Corpus:
    """Every usable document of the inputs, in input order, with counts of what was dropped and why."""
    by_format, hub = expand_inputs(specs)
    corpus = Corpus([], {"too_short": 0, "binary": 0, "duplicate": 0, "truncated": 0})
    seen: set[bytes] = set()
    tables = [(fmt, files, _load(fmt, files)) for fmt, files in by_format.items()]
    tables += [(name, [], _load(name, None, split)) for name in hub]
    for fmt, files, table in tables:
        column = "text" if fmt == "text" else text_column
        if column not in table.column_names:
            where = ", ".join(str(f) for f in files) or fmt
            raise DipacoError(f"{where} has no column {column!r} (columns: {', '.join(table.column_names)}); "
                              f"pass --text-column with the right name")
        has_label = label_column in table.column_names
        for f in files:
            corpus.inputs.append({"path": str(f), "bytes": f.stat().st_size, "sha256": sha256_file(f)})
        if not files:
            corpus.inputs.append({"dataset": fmt, "split": split, "fingerprint": getattr(table, "_fingerprint", None)})
        for row in table.select_columns([column] + ([label_column] if has_label else [])):
            text = row[column]
            if not isinstance(text, str):
                text = "" if text is None else str(text)
            text = text.strip()
            if "\x00" in text:
                corpus.dropped["binary"] += 1
                continue
            if len(text) < min_chars:
                corpus.dropped["too_short"] += 1
                continue
            if len(text) > max_chars:
                text = text[:max_chars]
                corpus.dropped["truncated"] += 1  # kept, but cut
            digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=16).digest()
            if digest in seen:
                corpus.dropped["duplicate"] += 1
                continue
            seen.add(digest)
            label = row.get(label_column) if has_label else None
            corpus.documents.append(Document(text, None if label is None else str(label)))
    if not corpus.documents:
        raise DipacoError(f"no usable documents in {', '.join(specs)} (dropped: {corpus.dropped}); "
                          f"check --text-column and --min-chars")
    return corpus


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
