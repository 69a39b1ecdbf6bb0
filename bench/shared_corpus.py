"""Where the benchmarks find the shared five-domain corpus (a directory of *.jsonl.gz): ``$DIPACO_CORPUS``,
else ``../shared/corpus`` beside the repository. One definition for bench/comm.py, shard.py, worker_speed.py
and routing_quality.py; bench/reproduce.py keeps its own line (``DEFAULT_DATA``, the same rule) because a
running experiment reads that file. The tests' copy is ``SHARED_CORPUS`` in tests/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

SHARED_CORPUS = Path(os.environ.get("DIPACO_CORPUS", Path(__file__).resolve().parents[2] / "shared" / "corpus"))
