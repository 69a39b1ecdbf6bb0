"""``dipaco train --workers N``: run the same command under a local torchrun (127.0.0.1 rendezvous)."""

from __future__ import annotations

import socket
import subprocess
import sys

from dipaco.errors import DipacoError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(workers: int, argv: list[str], max_restarts: int = 0, port: int | None = None) -> list[str]:
    """torchrun running ``dipaco <argv>`` on ``workers`` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(workers),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port or free_port()}",
            "--max-restarts", str(max_restarts), "-m", "dipaco.cli", *argv]


LAUNCHER_FLAGS = ("--workers", "--max-restarts")  # the launcher's own: a rank runs the command without them


def rank_argv(argv: list[str]) -> list[str]:
    """The command each rank runs: ``argv`` without the launcher's flags (``--workers 2`` or ``--workers=2``)."""
    out, after_flag = [], False
    for a in argv:
        if not after_flag and a not in LAUNCHER_FLAGS and not a.startswith(tuple(f + "=" for f in LAUNCHER_FLAGS)):
            out.append(a)
        after_flag = a in LAUNCHER_FLAGS and not after_flag
    return out


def launch_local(workers: int, argv: list[str], max_restarts: int = 0) -> int:
    """``dipaco <argv>`` (a command with --workers) on ``workers`` local torchrun ranks; its exit code."""
    if workers < 1:
        raise DipacoError(f"--workers must be >= 1, got {workers}")
    proc = subprocess.run(torchrun_command(workers, rank_argv(argv), max_restarts))
    return proc.returncode  # a worker's own error line is already on stderr
