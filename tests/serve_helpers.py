"""A real ``dipaco serve`` process on a free loopback port, for the serving tests and the benchmark."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

URL_LINE = re.compile(r"on (http://[\d.]+:\d+)/v1")


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, timeout: float = 120.0, wait: bool = True):
        self.args = [sys.executable, "-m", "dipaco.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.stderr: list[str] = []
        self.headers: dict = {}  # sent with every scrape of /metrics (a server with a key needs it)
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        if wait:
            self.ready(timeout)

    @classmethod
    def start_all(cls, *argsets: tuple[str, ...]) -> list["ServerProcess"]:
        """Several servers started side by side (their start-ups overlap), each ready when this returns."""
        servers = [cls(*args, wait=False) for args in argsets]
        for s in servers:
            s.ready()
        return servers

    def ready(self, timeout: float = 120.0) -> None:
        """Wait for the line that names the server's address."""
        deadline, line = time.time() + timeout, ""
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if URL_LINE.search(line) or self.proc.poll() is not None:
                break
        match = URL_LINE.search(line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"dipaco serve did not start: {line!r} {''.join(self.stderr)[-2000:]}")
        self.url = match.group(1)
        self.banner = line

    def get(self, route: str, headers: dict | None = None) -> tuple[int, str]:
        request = urllib.request.Request(self.url + route, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, route: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, method="POST",
                                         headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}"), {k.lower(): v for k, v in e.headers.items()}

    def metric(self, name: str) -> float:
        status, text = self.get("/metrics", self.headers)
        assert status == 200, f"/metrics answered {status}: {text[:200]}"
        values = [float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0] == name]
        return sum(values)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
