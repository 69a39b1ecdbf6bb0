"""Small file helpers shared by every stage: committing a directory, atomic text, JSON, hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.settings import read_parsed


def commit_dir(tmp: str | Path, final: str | Path) -> None:
    """Rename a complete temporary directory to ``final`` (replacing an existing one only now).

    The old ``final`` is moved aside first and put back if the rename fails, so a failure leaves the old
    directory in place and no ``.old`` copy behind."""
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        if not final.is_dir():  # never replace a file with a directory (checked before; a race or a library call)
            raise DipacoError(f"{final} is a file, not a directory; choose another output path")
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file under a temporary name, then rename it into place (the temporary file never stays)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path, what: str = "file") -> dict:
    return read_parsed(path, json.loads, json.JSONDecodeError,
                       what + " {path} is missing; point to a complete dipaco output directory",
                       what + " {path} is not valid JSON ({exc}); regenerate it", error=DipacoError)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_dir(path: str | Path) -> str:
    """Hash of every file's relative name and content under ``path`` (order-independent of the OS)."""
    path = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def log(stream, **record) -> None:
    """One JSON line of metrics.jsonl, flushed (a reader, or a crash, sees every line written)."""
    stream.write(json.dumps(record) + "\n")
    stream.flush()
