"""The server's counters, exposed at ``GET /metrics`` in Prometheus' text format (version 0.0.4).

Counters only grow; gauges are read when scraped. Batch sizes are a histogram of rows per forward pass, so a scrape
shows whether requests to one path really share passes.
"""

from __future__ import annotations

import threading
from collections import Counter

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()      # (endpoint, status)
        self.path_requests: Counter = Counter()  # path
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_steps: Counter = Counter()   # path
        self.batch_rows = Counter()              # bucket upper bound -> forward passes
        self.batch_sum = 0
        self.batch_count = 0
        self.max_batch = 0
        self.loads = 0
        self.load_bytes = 0
        self.load_seconds = 0.0
        self.evictions = 0
        self.route_seconds = 0.0
        self.routed_count = 0
        self.gauges = {}  # name -> (help, callable)

    # ------------------------------------------------------------- updates (any thread)
    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def path_request(self, path: str) -> None:
        with self.lock:
            self.path_requests[path] += 1

    def tokens(self, n: int) -> None:
        with self.lock:
            self.generated_tokens += n

    def _batch(self, rows: int) -> None:
        bucket = next((b for b in BATCH_BUCKETS if rows <= b), float("inf"))
        self.batch_rows[bucket] += 1
        self.batch_sum += rows
        self.batch_count += 1
        self.max_batch = max(self.max_batch, rows)

    def prefill(self, path: str, rows: int, tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += tokens
            self._batch(rows)

    def decode_step(self, path: str, rows: int) -> None:
        with self.lock:
            self.decode_steps[path] += 1
            self._batch(rows)

    def module_loads(self, n: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.loads += n
            self.load_bytes += nbytes
            self.load_seconds += seconds

    def module_evicted(self) -> None:
        with self.lock:
            self.evictions += 1

    def routed(self, seconds: float) -> None:
        with self.lock:
            self.route_seconds += seconds
            self.routed_count += 1

    def gauge(self, name: str, help_text: str, read) -> None:
        self.gauges[name] = (help_text, read)

    # ------------------------------------------------------------- the scrape
    def render(self) -> str:
        out: list[str] = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                out.append(f"{name}{label} {value}")

        with self.lock:
            metric("dipaco_requests_total", "counter", "HTTP requests by endpoint and status",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("dipaco_path_requests_total", "counter", "completions answered by each path",
                   [({"path": p}, n) for p, n in sorted(self.path_requests.items())])
            metric("dipaco_prompt_tokens_total", "counter", "prompt tokens prefilled", [({}, self.prompt_tokens)])
            metric("dipaco_generated_tokens_total", "counter", "tokens generated", [({}, self.generated_tokens)])
            metric("dipaco_decode_steps_total", "counter", "decode forward passes by path",
                   [({"path": p}, n) for p, n in sorted(self.decode_steps.items())])
            out += ["# HELP dipaco_batch_size rows per forward pass (prefill and decode)", "# TYPE dipaco_batch_size histogram"]
            cumulative = 0
            for b in BATCH_BUCKETS:
                cumulative += self.batch_rows[b]
                out.append(f'dipaco_batch_size_bucket{{le="{b}"}} {cumulative}')
            out += [f'dipaco_batch_size_bucket{{le="+Inf"}} {self.batch_count}', f"dipaco_batch_size_sum {self.batch_sum}",
                    f"dipaco_batch_size_count {self.batch_count}"]
            metric("dipaco_batch_size_max", "gauge", "the largest batch so far", [({}, self.max_batch)])
            metric("dipaco_module_loads_total", "counter", "modules loaded from the checkpoint", [({}, self.loads)])
            metric("dipaco_module_load_bytes_total", "counter", "module bytes loaded", [({}, self.load_bytes)])
            metric("dipaco_module_load_seconds_total", "counter", "seconds spent loading modules",
                   [({}, round(self.load_seconds, 6))])
            metric("dipaco_module_evictions_total", "counter", "modules evicted under the memory budget",
                   [({}, self.evictions)])
            metric("dipaco_routing_seconds_total", "counter", "seconds spent routing prompts",
                   [({}, round(self.route_seconds, 6))])
            metric("dipaco_routed_total", "counter", "prompts routed", [({}, self.routed_count)])
        for name, (help_text, read) in sorted(self.gauges.items()):
            metric(name, "gauge", help_text, [({}, read())])
        return "\n".join(out) + "\n"
