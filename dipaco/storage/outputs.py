"""Output paths, checked before any work: dipaco never deletes or overwrites what it did not write.

Every command that writes calls one of these first (``check_out_dir`` for a directory, ``check_out_file``
for a file), so a bad ``--out`` costs one line and exit code 2, not a traceback after the whole pass:

* the path's nearest existing ancestor is a writable directory (not a file, not read-only);
* a directory output is not a file, and is not, does not contain and does not lie inside an input;
* an existing directory is used only when it is empty or dipaco wrote it: its own marker file
  (``OWN_MARKERS``) of the kind the command writes. Anything else is refused, ``--overwrite`` or not;
  one exception: a run's policy folder holding only its policy file is dipaco's even when that file is damaged
  (``run_policy_folder``), so the command that writes it can replace it with ``--overwrite``.

``os_error_line`` turns an ``OSError`` that still happens (disk full, a race) into the one line ``cli.main``
prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

from dipaco.errors import DipacoError
from dipaco.io import commit_dir

QUICKSTART_MARKER = "dipaco-quickstart.json"

# kind -> (marker file, what its JSON must hold, words for messages). A marker's content is checked too, so a
# user's own manifest.json or run.json does not make their directory "ours".
OWN_MARKERS = {
    "shards": ("manifest.json", lambda m: m.get("format") == "dipaco-shards", "dipaco shard directory"),
    "run": ("run.json", lambda m: "shards_fingerprint" in m, "dipaco run directory"),
    "export": ("dipaco_export.json", lambda m: "dipaco_version" in m, "dipaco export"),
    "router": ("router.json", lambda m: "kind" in m, "dipaco router"),
    "once policy": ("once.json", lambda m: "chosen" in m and "reason" in m, "dipaco routing choice"),
    "window policy": ("policy.json", lambda m: "chosen" in m and "reason" in m, "dipaco every-W routing choice"),
    "quickstart": (QUICKSTART_MARKER, lambda m: m.get("format") == "dipaco-quickstart", "dipaco quickstart directory"),
}


def owner_kind(directory: str | Path) -> str | None:
    """The kind of dipaco output ``directory`` is (by its marker file), or None."""
    directory = Path(directory)
    for kind, (marker, valid, _) in OWN_MARKERS.items():
        try:
            content = json.loads((directory / marker).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(content, dict) and valid(content):
            return kind
    return None


def listing(directory: Path, show: int = 3) -> str:
    """'a, b, c and 4 more': what a directory holds, for a message."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    more = f" and {len(names) - show} more" if len(names) > show else ""
    return ", ".join(names[:show]) + more


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_writable(out: Path, flag: str) -> None:
    """The nearest existing ancestor of ``out`` must be a directory we may create entries in."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise DipacoError(f"{flag} {out} lies under {parent}, which is a file; choose a path in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "is on a read-only file system" if read_only else "is not writable (permission denied)"
        raise DipacoError(f"cannot write {flag} {out}: {parent} {why}; choose another {flag}")


def check_not_input(out: Path, flag: str, inputs: dict[str, Iterable]) -> None:
    """``out`` must not be, contain or lie inside a local input (hub names and unset inputs are skipped)."""
    target = out.resolve()
    for name, values in inputs.items():
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if not value or not Path(value).exists():
                continue
            src = Path(value).resolve()
            if target == src:
                how = "is"
            elif src.is_relative_to(target):
                how = "contains"
            elif target.is_relative_to(src):
                how = "lies inside"
            else:
                continue
            raise DipacoError(f"{flag} {out} {how} the input {name} {value}; write the output outside the inputs")


def check_out_dir(out: str | Path, kind: str, flag: str = "--out", inputs: dict | None = None,
                  overwrite: bool | None = None) -> Path:
    """Check a directory output before any work.

    ``overwrite`` None: the command continues in an existing directory of its ``kind`` (train --resume,
    quickstart); True/False: the command replaces the directory, which then needs ``--overwrite``. Either
    way only an empty directory or one dipaco wrote as ``kind`` is used."""
    out = Path(out)
    check_not_input(out, flag, inputs or {})
    if out.exists() and not out.is_dir():
        raise DipacoError(f"{flag} {out} is a file, not a directory; choose a directory path")
    check_writable(out, flag)
    if not out.is_dir() or _is_empty_dir(out) and overwrite is None:
        return out
    found = owner_kind(out)
    want = OWN_MARKERS[kind][2]
    if found is None and not _is_empty_dir(out):
        extra = "; --overwrite only replaces a directory dipaco wrote" if overwrite else ""
        raise DipacoError(f"{flag} {out} holds files dipaco did not write ({listing(out)}); "
                          f"choose a new or empty directory{extra}")
    if found is not None and found != kind:
        raise DipacoError(f"{flag} {out} is a {OWN_MARKERS[found][2]}, not a {want}; choose another {flag}")
    if overwrite is False:
        raise DipacoError(f"{out} already exists; choose another {flag} or pass --overwrite")
    return out


# the folders a command keeps inside a run directory, each for one policy file: (where, relative to the run, the
# folder's name pattern, file name); see dipaco.eval.once_policy and dipaco.eval.window_policy
RUN_POLICY_FOLDERS = ((("routing",), "once.json"), (("window_routers", "w*"), "policy.json"))
POLICY_MAX_BYTES = 1 << 20  # policies are a few kB; a bigger file of that name is not taken for one


def run_policy_folder(directory: Path) -> bool:
    """A policy folder of a dipaco run that holds nothing but its policy file, whatever that file holds: dipaco's name in
    dipaco's folder, so ``--overwrite`` may replace it even when the file is damaged (the command that rewrites it is
    the way out). Anything else beside the file (a user's notes, a link), or a file too big to be a policy, keeps the
    folder the user's."""
    for parts, name in RUN_POLICY_FOLDERS:
        run = directory.parents[len(parts) - 1] if len(directory.parents) >= len(parts) else None
        if run is None or not directory.relative_to(run).match("/".join(parts)):
            continue
        f = directory / name
        if (owner_kind(run) == "run" and [p.name for p in directory.iterdir()] == [name] and f.is_file()
                and not f.is_symlink() and f.stat().st_size <= POLICY_MAX_BYTES):
            return True
    return False


def check_replaceable(existing: Path) -> None:
    """The last guard before a writer replaces ``existing``: an empty directory or one dipaco wrote."""
    if not existing.is_dir():
        raise DipacoError(f"{existing} is a file, not a directory; choose another output path")
    if owner_kind(existing) is None and any(existing.iterdir()) and not run_policy_folder(existing):
        raise DipacoError(f"{existing} holds files dipaco did not write ({listing(existing)}); "
                          f"choose a new or empty directory")


def _head(path: Path, n: int = 512) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _starts_with(path: Path, prefix: bytes) -> bool:
    return _head(path).startswith(prefix)


def _png_by_matplotlib(path: Path) -> bool:
    head = _head(path)
    return head.startswith(b"\x89PNG") and b"Matplotlib" in head


def _dipaco_report(path: Path) -> bool:
    try:
        if path.stat().st_size > 64 << 20:  # reports are small; do not read a big file of the user's
            return False
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and "methods" in content


def replaceable_file(path: Path) -> bool:
    """A file dipaco may overwrite: one of its own reports or plots (an eval report, a matplotlib PNG)."""
    if path.suffix.lower() == ".png":
        return _png_by_matplotlib(path)
    if path.suffix.lower() == ".md":
        return _starts_with(path, b"| method | perplexity |")
    return _dipaco_report(path)


def check_out_file(out: str | Path, flag: str = "--out", beside: Iterable[Path] = ()) -> Path:
    """Check a file output (and the files written ``beside`` it): not a directory, and an existing one only
    when dipaco wrote it. The companions of an existing dipaco report (its .md, plots) are its own."""
    out = Path(out)
    if out.is_dir():
        raise DipacoError(f"{flag} {out} is a directory; give a file name, e.g. {out / 'report.json'}")
    check_writable(out, flag)
    if out.exists() and not replaceable_file(out):
        raise DipacoError(f"{flag} {out} already exists and dipaco did not write it; choose another {flag}")
    ours = out.exists()
    for f in beside:
        if f.is_dir() or f.exists() and not ours and not replaceable_file(f):
            raise DipacoError(f"{flag} {out} would overwrite {f}, which dipaco did not write; choose another {flag}")
    return out


def os_error_line(exc: OSError) -> str:
    """One line for a file-system error: the path(s) and the cause."""
    where = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    cause = " ".join((exc.strerror or str(exc) or type(exc).__name__).split())  # one line, whatever the message
    return (f"{where}: {cause}" if where else cause) + " (a file-system error; check the path, its permissions and free space)"


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False):
    """Yield a temporary directory that becomes ``final`` only if the block completes.

    On any exception the temporary directory is removed and ``final`` is untouched. An existing
    ``final`` is an error unless ``overwrite``; then it is replaced only after the new one is whole, and
    only when it is empty or dipaco wrote it (never a user's directory or file).
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise DipacoError(f"{final} already exists; choose another output path or pass --overwrite")
    if final.exists():
        check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
