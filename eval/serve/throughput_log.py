"""``dipaco serve --log-to``: the server's throughput, every ``log_interval`` seconds and once more at shutdown, to the
tracker run of the run it serves (``dipaco.training.trackers``), beside that run's training rounds and eval table.

The points are plotted against seconds of serving (``serve/elapsed_s``), not against rounds: a served model stays at
one round while the server runs. The seconds add up over the servers of one run (RUN/trackers.json keeps the count),
so a later server's points follow the earlier ones'.
"""

from __future__ import annotations

import threading
import time

from dipaco.training.trackers import Trackers

AXIS = "serve/elapsed_s"


class ThroughputLog:
    """A thread that reads the server's counters (``Metrics``) and writes one point per interval."""

    def __init__(self, trackers: Trackers, metrics, interval: float):
        self.trackers, self.metrics, self.interval = trackers, metrics, interval
        self.started = self.last_at = time.monotonic()
        self.before = max(float(s.get("serve_s", 0.0)) for s in trackers.state.values())  # earlier servers' seconds
        self.last_tokens, self.last_step = 0, int(self.before)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dipaco-throughput-log", daemon=True)
        self.thread.start()

    @classmethod
    def open(cls, run_dir: str, log, metrics, interval: float) -> ThroughputLog | None:
        """The log of a served run when ``log`` (a ``LogConfig``) names trackers, else None."""
        trackers = Trackers.open(run_dir, log, catch_up=False)
        return cls(trackers, metrics, interval) if trackers is not None else None

    def _loop(self) -> None:
        while not self.stopping.wait(self.interval):
            self.point()

    def point(self) -> None:
        """Tokens per second since the last point, and the totals so far."""
        now = time.monotonic()
        elapsed = self.before + now - self.started
        if int(elapsed) <= self.last_step:
            return  # a second point within one second (the last one, at shutdown) would repeat its step
        with self.metrics.lock:
            generated, prompt = self.metrics.generated_tokens, self.metrics.prompt_tokens
            requests = sum(self.metrics.requests.values())
        window = max(now - self.last_at, 1e-9)
        self.trackers.series({AXIS: elapsed, "serve/tokens_per_s": (generated - self.last_tokens) / window,
                              "serve/generated_tokens": float(generated), "serve/prompt_tokens": float(prompt),
                              "serve/requests": float(requests)}, AXIS)
        self.last_at, self.last_tokens, self.last_step = now, generated, int(elapsed)
        self.trackers.note("serve_s", elapsed)

    def close(self) -> None:
        """The last point (what was served since the previous one), then the trackers closed."""
        self.stopping.set()
        self.thread.join()
        self.point()
        self.trackers.close()
