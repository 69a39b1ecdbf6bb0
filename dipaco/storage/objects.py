"""One storage interface over a local directory and an object store (fsspec URLs: ``s3://``, ``gs://``, ``memory://``).

A ``Storage`` is rooted at a run (or shard) directory and reads and writes objects by relative key
(``queue/phases/1/trainee_0/commit.json``). Object stores have no rename, so nothing here needs one:

  ``write``             put an object (whole, or not at all: a reader never sees half of it); for names no one else
                        writes (an attempt's own objects) and for files that are replaced (``latest``, metrics)
  ``create_if_absent``  the commit primitive: put an object only if none exists under its key, atomically, and say
                        whether it did. S3: a conditional PUT ``If-None-Match: *``; GCS: ``ifGenerationMatch=0``
                        (both through their fsspec backend's ``mode="create"``); local: a hard link of a fully
                        written temporary file (``link`` refuses an existing name), so the first attempt wins
  ``read``, ``exists``, ``list``, ``copy``, ``delete``, ``get_file``

Every instance counts the bytes it reads and writes (``read_bytes``, ``written_bytes``): the Ray engine's phases
report them per phase in metrics.jsonl. The object-store libraries are optional extras; a missing one is one line
naming it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from pathlib import Path

from dipaco.errors import DipacoError

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def is_url(location: str | Path) -> bool:
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _filesystem(url: str):
    import fsspec

    protocol = url.split("://", 1)[0]
    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if protocol in ("s3", "s3a") and endpoint:  # an S3-compatible store (MinIO, a test server)
        options["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        return fsspec.filesystem(protocol, **options)
    except ImportError:
        extra = _EXTRAS.get(protocol)
        fix = f'pip install "dipaco[{extra}]"' if extra else f"install the fsspec backend for {protocol}://"
        raise DipacoError(f"{url}: {protocol}:// paths need an optional extra; {fix}") from None
    except ValueError as exc:
        raise DipacoError(f"{url}: no storage backend for {protocol}:// ({exc}); use a local path, s3:// or gs://") from None


class Storage:
    """Objects under ``root`` (a local directory or an fsspec URL), by relative key."""

    def __init__(self, root: str | Path):
        self.root = str(root).rstrip("/") if is_url(root) else str(Path(str(root).removeprefix("file://")))
        self.remote = is_url(self.root)
        self.fs = _filesystem(self.root) if self.remote else None
        self.read_bytes = self.written_bytes = 0

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    def where(self, key: str) -> str:
        """The object's full name: a URL, or a local path."""
        return f"{self.root}/{key}" if self.remote else str(Path(self.root) / key)

    def counters(self) -> dict[str, int]:
        return {"storage_read": self.read_bytes, "storage_written": self.written_bytes}

    # ------------------------------------------------------------------------------------------ reading
    def read(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        if self.remote:
            data = self.fs.cat_file(self.where(key))
        else:
            data = Path(self.where(key)).read_bytes()
        self.read_bytes += len(data)
        return data

    def exists(self, key: str) -> bool:
        if self.remote:
            self.fs.invalidate_cache(self.where(key))  # another process may have created it since a listing
            return self.fs.exists(self.where(key))
        return Path(self.where(key)).exists()

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (objects and folders; hidden names left out), sorted."""
        if self.remote:
            try:
                entries = self.fs.ls(self.where(prefix), detail=False, refresh=True)
            except FileNotFoundError:
                return []
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        else:
            folder = Path(self.where(prefix))
            names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
        return sorted(n for n in names if n and not n.startswith("."))

    def get_file(self, key: str, local: Path) -> None:
        """Copy the object to a local file (written under a temporary name, then renamed)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.parent / f".{local.name}.tmp-{uuid.uuid4().hex[:8]}"
        if self.remote:
            self.fs.get_file(self.where(key), str(tmp))
        else:
            shutil.copyfile(self.where(key), tmp)
        self.read_bytes += tmp.stat().st_size
        os.replace(tmp, local)

    # ------------------------------------------------------------------------------------------ writing
    def write(self, key: str, data: bytes) -> None:
        """Put an object, replacing any; whole or not at all (a local file is renamed into place)."""
        if self.remote:
            self.fs.pipe_file(self.where(key), data)
        else:
            final = Path(self.where(key))
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.write_bytes(data)
            os.replace(tmp, final)
        self.written_bytes += len(data)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Put an object only if none exists under ``key``; True if this call created it (see the module docstring)."""
        if self.remote:
            try:
                self.fs.pipe_file(self.where(key), data, mode="create")
            except FileExistsError:
                return False
            except OSError as exc:  # s3fs names a refused condition only when the server says which condition
                if exc.errno == errno.EINVAL and "precondition" in str(exc).lower():
                    return False
                raise
        else:
            final = Path(self.where(key))
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.write_bytes(data)
            try:
                os.link(tmp, final)  # refuses an existing name; the content is whole before the name appears
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
        self.written_bytes += len(data)
        return True

    def copy(self, source: str, target: str) -> None:
        """Copy an object within this storage (server side on an object store; a hard link where possible locally)."""
        if self.remote:
            self.fs.copy(self.where(source), self.where(target))
            return
        src, dst = Path(self.where(source)), Path(self.where(target))
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except FileExistsError:
            dst.unlink()
            os.link(src, dst)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(src, dst)

    def delete(self, key: str) -> None:
        """Remove an object or a whole folder; nothing happens when there is none."""
        if self.remote:
            try:
                self.fs.rm(self.where(key), recursive=True)
            except FileNotFoundError:
                pass
            return
        p = Path(self.where(key))
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
