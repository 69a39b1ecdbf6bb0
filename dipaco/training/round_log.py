"""One round log for every training engine: a finished round's lines in metrics.jsonl, the progress bar and its
round line (the bar's postfix), and the listeners (trackers) that see the same records.

The engines differ only in how they learn a round's facts (the in-process and torchrun loop gathers its workers'
reports, ``dipaco.training.train``; the Ray driver reads its phases' commit records); what they write is decided
here, once, so metrics.jsonl has the same shape whichever engine trained the run.

API::

    log = RoundLog(run_dir, total_steps, desc="train run", progress=True, done_steps=0, writes=True, listeners=())
    log.advance(steps)                 # inner steps done since the last call (the bar)
    line = log.round(r, losses_by_trainee, val, seconds=..., tokens=..., workers=..., bytes_sent=..., bytes_received=...,
                     inner=[...], engine=None, **extra)
    log.close()

``run_dir``        the local folder whose metrics.jsonl is appended to (a run in a bucket: its local copy; the
                   engine pushes the file where it belongs)
``total_steps``    the bar's length in inner steps (of every trainee this log counts); ``done_steps`` already done
``writes``         False on a process that takes part without writing (a torchrun rank other than 0): no file, no bar
``listeners``      callables each given every record written, in order (the inner lines, then the round line):
                   trackers write from the same records as metrics.jsonl

``round`` writes round ``r`` (1-based: the round that ends at module version ``r``):
``losses_by_trainee``  every trainee's mean inner loss of the round, in trainee order; None for a trainee with no
                       phase in it (a dropped phase)
``val``                path -> validation loss of the global weights at version ``r`` (paths too short for a
                       window are absent)
``seconds, tokens, workers, bytes_sent, bytes_received``  the round's time, trained tokens (``phase_tokens`` per
                       trainee that trained), the workers present, and the bytes of its outer gradients
``inner``              the round's inner-step records (``engine_steps.inner_record``, losses as floats), any
                       order: written sorted by (step, trainee), before the round line
``engine``             written after ``round`` when given (the Ray driver names itself)
``extra``              each engine's own fields, last (the in-process engine: compute_s, comm_s, wait_s, by_worker;
                       the Ray driver: bytes_loaded, storage_read, storage_written, compute_s, load_s, save_s,
                       dropped, retried, phases, steps)
It returns the round line as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from tqdm.auto import tqdm

from dipaco.io import log as write_line
from dipaco.training.engine_steps import round_line


def phase_tokens(cfg) -> int:
    """Tokens one trainee trains on in one round: H steps of a batch of windows."""
    return cfg.inner_steps * cfg.inner.batch_size * cfg.model.max_seq_len


class RoundLog:
    """metrics.jsonl, the bar and the listeners of one run (see the module docstring for the API)."""

    def __init__(self, run_dir: str | Path | None, total_steps: int, desc: str = "train", progress: bool = True,
                 done_steps: int = 0, writes: bool = True, listeners: Iterable[Callable[[dict], None]] = ()):
        self.writes = writes and run_dir is not None
        self.metrics = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") if self.writes else None
        self.listeners = list(listeners)
        self.bar = tqdm(total=total_steps, initial=done_steps, desc=desc, unit="step", dynamic_ncols=True,
                        disable=not progress or not self.writes, mininterval=1.0)

    def advance(self, steps: int) -> None:
        self.bar.update(steps)

    def round(self, r: int, losses_by_trainee: list[float | None], val: dict[str, float], *, seconds: float,
              tokens: int, workers: int, bytes_sent: int, bytes_received: int, inner: Iterable[dict] = (),
              engine: str | None = None, **extra) -> dict:
        line = round_line(r, losses_by_trainee, val, seconds, tokens, workers, bytes_sent, bytes_received, engine,
                          **extra)
        if not self.writes:
            return line
        for record in sorted(inner, key=lambda x: (x["step"], x["trainee"])):
            self._write(record)
        self._write(line)
        if line["train_loss"] is not None:
            self.bar.set_postfix(round=r, loss=f"{line['train_loss']:.3f}")
        return line

    def _write(self, record: dict) -> None:
        write_line(self.metrics, **record)
        for listener in self.listeners:
            listener(record)

    def close(self) -> None:
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
