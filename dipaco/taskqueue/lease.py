"""One driver per run directory: a lease object (``RUN/lease.json``) with its owner, host, pid and a heartbeat.

A driver takes the lease by creating the object only if none exists (``Storage.create_if_absent``), and renews its
heartbeat every ``BEAT_S`` seconds while it runs. A second driver is refused in one line naming the first. A dead
driver's successor takes the lease over: at once when the holder ran on this machine and its process is gone, else
once its heartbeat is ``EXPIRY_S`` seconds old (a ``--keep-going`` supervisor's drivers run on its machine, so each
new one takes over from the one it stopped at once).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from dipaco.errors import DipacoError
from dipaco.storage.objects import Storage

KEY = "lease.json"
BEAT_S = 10.0
EXPIRY_S = 60.0


def _alive(holder: dict) -> bool:
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
            return True
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, KeyError, TypeError):
            return True
    return time.time() - float(holder.get("heartbeat", 0)) < EXPIRY_S


def only_a_lease(folder) -> bool:
    """Whether a local folder holds nothing but what a driver writes before the run's own files: its lease (a
    driver stopped or killed before it created run.json; the lease is taken over as usual) and a queue."""
    from pathlib import Path

    folder = Path(folder)
    try:
        names = {p.name for p in folder.iterdir()}
        body = json.loads((folder / KEY).read_text())
    except (OSError, ValueError):
        return False
    return KEY in names and names <= {KEY, "queue"} and isinstance(body, dict) and {"owner", "pid"} <= set(body)


class Lease:
    def __init__(self, location: str):
        self.storage, self.location = Storage(location), location
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "heartbeat": time.time()}).encode()

    def holder(self) -> dict | None:
        try:
            body = json.loads(self.storage.read(KEY))
            return body if isinstance(body, dict) else {}
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # damaged: no one holds it

    def acquire(self) -> "Lease":
        for _ in range(5):
            holder = self.holder()
            if holder is None:
                if self.storage.create_if_absent(KEY, self._body()):
                    self._thread = threading.Thread(target=self._beat, daemon=True, name="dipaco-lease")
                    self._thread.start()
                    return self
                continue
            if holder and _alive(holder):
                age = time.time() - float(holder.get("heartbeat", 0))
                raise DipacoError(f"{self.location} is being trained by another driver (host {holder.get('host')}, pid "
                                  f"{holder.get('pid')}, heartbeat {age:.0f} s ago); stop that one first, or wait "
                                  f"{EXPIRY_S:.0f} s after it died")
            self.storage.delete(KEY)  # its driver is gone: take it over
        raise DipacoError(f"could not take the lease of {self.location} ({KEY} keeps changing); is another driver "
                          f"starting on it?")

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            holder = self.holder()
            if holder is not None and holder.get("owner") not in (self.owner, None):
                return  # taken over (we were presumed dead): stop renewing someone else's lease
            try:
                self.storage.write(KEY, self._body())
            except OSError:
                continue  # storage unreachable for a moment: try again at the next beat

    def release(self) -> None:
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=5)
        holder = self.holder()
        if holder is not None and holder.get("owner") == self.owner:
            self.storage.delete(KEY)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
