"""Processes a command starts end with it, even when it is killed (SIGKILL runs no exit handler of its own).

  ``die_with_parent``   called first in a child process (a shard pool worker, a local training worker): Linux's
                        parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) ends it when the process that
                        started it ends, however that ends; a child whose parent is already gone ends at once
  ``watch_local_ray``   the local Ray a driver starts (GCS, raylet, and the agents and workers the raylet starts,
                        which are not the driver's children and outlive a SIGKILLed driver): a small watcher in a
                        session of its own waits for the driver's end (the end of a pipe only the driver holds), then
                        kills every process whose command line or open files name that Ray session

Both are Linux-only; elsewhere they do nothing (``ray.shutdown`` and the pool's own shutdown still run on every
exit that runs code).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """End this process with SIGKILL when ``parent`` (the pid that started it) ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os._exit(1)


# The watcher: stdin is a pipe whose other end only the driver holds; EOF means the driver has ended.
_WATCHER = r"""
import os, signal, sys, time
session, driver = sys.argv[1], int(sys.argv[2])
sys.stdin.buffer.read()
spare = {os.getpid(), driver}  # the driver holds its own Ray log files open: when it closed the pipe itself, it lives on


def of_session(pid):
    # Ray's agents rename themselves (ray::DashboardAgent): their open log files still name the session
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if session.encode() in f.read():
                return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if session in os.readlink(f"/proc/{pid}/fd/{fd}"):
                return True
    except OSError:
        pass
    return False


for _ in range(5):  # again, for a process started while the others were being killed
    found = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in spare and of_session(p)]
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if not found:
        break
    time.sleep(0.2)
"""


def watch_local_ray(session: str) -> subprocess.Popen | None:
    """Start the watcher of a local Ray session (``session``: its name, e.g. ``session_2026-..._1234``, which every
    process of that Ray has on its command line or in the names of the log files it holds open); the caller keeps the returned process's stdin open until its own
    end (closing it earlier kills that Ray at once)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc") or not session:
        return None
    return subprocess.Popen([sys.executable, "-c", _WATCHER, session, str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
