"""Continuous batching by path: one thread runs every forward pass of the server.

Requests routed to the same path share forward passes. Each resident path with work has a running batch: one KV cache
(transformers' ``DynamicCache``), its rows left-padded to a common length, with an attention mask over the padding
and each row's own position ids. Between decode steps, new requests join (their prompts are prefilled together, then
their cache rows are padded and stacked onto the batch) and finished or cancelled ones leave (their rows are dropped,
and padding columns no row needs any more are cut). The copies happen only when a row joins or leaves; a decode step
appends one column.

A ``Job`` asks for up to ``max_new`` tokens of one path after ``ids`` (0: only score ``ids``). It reports through
``emit(kind, payload)``, called on this thread: ``("prompt", [(logprob, top), ...])`` for every context token after
the first when ``prompt_logprobs``, ``("token", (id, logprob, top))`` per new token, then ``("done", reason)`` with
reason ``stop`` (end of text), ``length`` or ``cancelled``, or ``("error", message)``.
Log-probabilities are the model's own (before temperature and top-p); ``top`` holds the ``top_logprobs`` most likely
tokens as ``[(id, logprob)]``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Job:
    path: str
    ids: list[int]
    max_new: int
    emit: Callable[[str, object], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    cancelled: bool = False       # set by the request's side (a stop string, a client gone); the batcher drops the row
    pinned: bool = False          # from its prefill to its end, the job keeps its path's modules resident
    generated: int = 0
    last: int = 0
    position: int = 0
    generator: torch.Generator | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.seed if self.seed is not None else int(torch.randint(2**62, ()).item()))


class PathBatch:
    """The running rows of one path: their jobs, their cache and mask (rows left-padded to a common length)."""

    def __init__(self, path: str, model):
        from transformers import DynamicCache

        self.path, self.model = path, model
        self.jobs: list[Job] = []
        self.cache = DynamicCache(config=model.config)  # one object for the batch's life: its tensors are swapped
        self.mask = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def _set(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.cache.layers, kv):
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v

    def add(self, jobs: list[Job], kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        if not self.jobs:
            self.jobs, self.mask = list(jobs), mask
            self._set(kv)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self._set([(torch.cat([_left_pad(k0, width), _left_pad(k1, width)]), torch.cat([_left_pad(v0, width), _left_pad(v1, width)]))
                   for (k0, v0), (k1, v1) in zip(self.kv, kv)])
        self.mask = torch.cat([_left_pad_mask(self.mask, width), _left_pad_mask(mask, width)])
        self.jobs += jobs

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, then cut the leading columns that are padding in every remaining row."""
        if len(rows) == len(self.jobs):
            return
        self.jobs = [self.jobs[i] for i in rows]
        if not rows:
            self.mask = torch.zeros(0, 0, dtype=torch.bool)
            return
        index = torch.tensor(rows)
        self.mask = self.mask[index]
        first = int(self.mask.any(0).nonzero()[0])
        self._set([(k[index, :, first:], v[index, :, first:]) for k, v in self.kv])
        self.mask = self.mask[:, first:]

    def step(self) -> torch.Tensor:
        """One decode step of every row: feeds each row's last token, returns the logits (rows, vocab)."""
        ids = torch.tensor([[j.last] for j in self.jobs])
        positions = torch.tensor([[j.position] for j in self.jobs])
        self.mask = torch.cat([self.mask, torch.ones(len(self.jobs), 1, dtype=torch.bool)], dim=1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    short = width - t.shape[2]
    return t if short == 0 else torch.cat([t.new_zeros(t.shape[0], t.shape[1], short, t.shape[3]), t], dim=2)


def _left_pad_mask(m: torch.Tensor, width: int) -> torch.Tensor:
    short = width - m.shape[1]
    return m if short == 0 else torch.cat([m.new_zeros(m.shape[0], short), m], dim=1)


@torch.inference_mode()
def prefill(model, jobs: list[Job]) -> tuple[torch.Tensor, list, torch.Tensor, list]:
    """Run the jobs' contexts through ``model`` together (left-padded): the last position's logits (rows, vocab), the
    cache as [(keys, values)] per layer, the padding mask, and per job its context's log-probabilities (or None)."""
    width = max(len(j.ids) for j in jobs)
    ids = torch.zeros(len(jobs), width, dtype=torch.long)
    mask = torch.zeros(len(jobs), width, dtype=torch.bool)
    for i, j in enumerate(jobs):
        ids[i, width - len(j.ids):] = torch.tensor(j.ids)
        mask[i, width - len(j.ids):] = True
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    every = any(j.prompt_logprobs for j in jobs)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=0 if every else 1)
    logits = out.logits.float()
    prompt = [None] * len(jobs)
    if every:
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        for i, j in enumerate(jobs):
            if j.prompt_logprobs:
                pad = width - len(j.ids)
                rows = logp[i, pad:]
                prompt[i] = _prompt_logprobs(rows, j.ids, j.top_logprobs)
    kv = [(layer.keys, layer.values) for layer in out.cache.layers]
    return logits[:, -1], kv, mask, prompt


def _prompt_logprobs(rows: torch.Tensor, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Every context token's log-probability after the first, with its top alternatives, all rows at once (a loop
    over tokens would cost more than the forward pass of a small model)."""
    lps = rows.gather(1, torch.tensor(ids[1:], dtype=torch.long)[:, None])[:, 0].tolist()
    if not top:
        return [(lp, []) for lp in lps]
    values, indices = rows.topk(top, dim=-1)
    return [(lp, list(zip(ix, vs))) for lp, ix, vs in zip(lps, indices.tolist(), values.tolist())]


def sample(jobs: list[Job], logits: torch.Tensor) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """The next token of every row: greedy at temperature 0, else temperature and nucleus sampling with the row's own
    generator; with its model log-probability and top alternatives. One softmax and one argmax for the whole batch."""
    logp = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1).tolist()
    for i, job in enumerate(jobs):
        if job.temperature > 0:
            probs = torch.softmax(logits[i] / job.temperature, dim=-1)
            if not bool(torch.isfinite(probs).all()):  # a temperature so small the logits overflow: its limit, greedy
                continue
            if job.top_p < 1:
                sorted_p, order = probs.sort(descending=True)
                drop = sorted_p.cumsum(0) - sorted_p >= job.top_p  # the top token always stays
                probs = probs.index_put((order[drop],), torch.zeros(()))
            tokens[i] = int(torch.multinomial(probs, 1, generator=job.generator))
    chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    out = []
    for i, job in enumerate(jobs):
        top = []
        if job.top_logprobs:
            values, indices = logp[i].topk(job.top_logprobs)
            top = list(zip(indices.tolist(), values.tolist()))
        out.append((tokens[i], chosen[i], top))
    return out


class Batcher:
    """The serving loop. ``submit`` is thread-safe; every forward pass runs on the batcher's own thread, and cold
    paths are loaded on a loader thread meanwhile, so requests for resident paths keep being answered."""

    def __init__(self, cache, eos: int, max_batch: int = 32, metrics=None, max_position: int | None = None):
        self.cache, self.eos, self.max_batch, self.metrics = cache, eos, max_batch, metrics
        self.max_position = max_position
        self.inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.waiting: dict[str, list[Job]] = {}
        self.batches: dict[str, PathBatch] = {}
        self.loads: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.loading: set[str] = set()  # asked of the loader, not yet started
        self.held: set[str] = set()  # loaded for waiting jobs and pinned by the loader until those jobs start
        self.blocked: set[str] = set()  # cold paths that did not fit: resident paths take no new rows until they load
        self.failed: dict[str, str] = {}  # path -> why its load failed (the loader says, the batcher answers its jobs)
        self.wake = threading.Event()
        self.stopping = False
        self.stopped = False  # the loop has ended: submissions are refused
        self.in_flight = 0  # jobs submitted and not done (the server bounds this)
        self._count = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, name="dipaco-batcher", daemon=True),
                        threading.Thread(target=self._loader, name="dipaco-loader", daemon=True)]

    def start(self) -> "Batcher":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.loads.put("")

    def submit(self, job: Job) -> None:
        with self._count:  # under the lock: a job is either refused here or answered by the stopped loop's drain
            stopped = self.stopped
            if not stopped:
                self.in_flight += 1
                self.inbox.put(job)
        if stopped:
            job.emit("error", "the server is stopping")
            return
        self.wake.set()

    # ----------------------------------------------------------------- the loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self.stopping:
            self.wake.clear()
            self._admit()
            try:
                worked = self._start_rows()
                worked |= self._decode()
            except Exception as exc:  # a bug or memory outside a forward pass: the rows in hand fail, the loop lives
                for batch in self.batches.values():
                    for j in batch.jobs:
                        self._finish(j, "error", f"the batcher failed: {type(exc).__name__}: {exc}")
                self.batches.clear()
                worked = True
            if not worked:  # a submission or a finished load wakes it; the timeout notices cancelled waiting jobs
                self.wake.wait(0.05 if self.waiting or self.batches else 1.0)
        # stopped: every job not done ends now, else whoever waits for it (a routing thread in Engine.run_jobs, which
        # has no timeout) waits forever, and the process cannot exit
        with self._count:
            self.stopped = True
        self._admit()
        for job in [j for js in self.waiting.values() for j in js] + [j for b in self.batches.values() for j in b.jobs]:
            self._finish(job, "error", "the server stopped before this request was answered")
        self.waiting, self.batches = {}, {}

    def _admit(self) -> None:
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.waiting.setdefault(job.path, []).append(job)

    def _start_rows(self) -> bool:
        """Prefill waiting jobs of resident paths (up to the batch limit) and ask the loader for cold ones."""
        worked = False
        for path in list(self.held) + list(self.failed):
            if not self.waiting.get(path):  # every job of a path being loaded left meanwhile: give back the loader's
                self.failed.pop(path, None)  # pin (kept, it would hold the memory for good) and forget a stale failure
                self._release(path)
        for path in list(self.waiting):
            jobs = [j for j in self.waiting[path] if not self._drop_cancelled(j)]
            self.waiting[path] = jobs
            if not jobs:
                del self.waiting[path]
                self._release(path)
                continue
            if path in self.failed:
                self._fail_path(path, self.failed.pop(path))
                continue
            model = self.cache.model(path)
            if model is None:
                if path not in self.loading:
                    self.loading.add(path)
                    self.loads.put(path)
                continue
            if self.blocked - {path} and path not in self.held:
                continue  # another path waits for memory: this one drains (one loaded for its waiting jobs goes on)
            room = self.max_batch - len(self.batches[path].jobs) if path in self.batches else self.max_batch
            if room <= 0:
                continue
            start, self.waiting[path] = jobs[:room], jobs[room:]
            self._prefill(path, model, start)
            self._release(path)
            worked = True
        return worked

    def _release(self, path: str) -> None:
        """The loader's pin of a path loaded for waiting jobs, once they started (or left)."""
        self.loading.discard(path)
        with self._count:  # against the loader adding its pin of this path right now
            if path in self.held:
                self.held.discard(path)
                self.cache.pin(path, -1)

    def _prefill(self, path: str, model, jobs: list[Job]) -> None:
        self.cache.pin(path, len(jobs))
        if self.cache.model(path) is not model:  # the loader evicted it between our look and this pin: rows on it
            self.cache.pin(path, -len(jobs))  # would hold memory the budget no longer counts; load it again first
            self.waiting[path] = jobs + self.waiting.get(path, [])
            return
        for j in jobs:
            j.pinned = True
        try:
            last, kv, mask, prompt = prefill(model, jobs)
        except Exception as exc:  # a bug, or memory: these requests fail, the server goes on
            for j in jobs:
                self._finish(j, "error", f"the forward pass failed: {type(exc).__name__}: {exc}")
            return
        if self.metrics is not None:
            self.metrics.prefill(path, len(jobs), sum(len(j.ids) for j in jobs))
        rows, keep = [], []
        for i, j in enumerate(jobs):
            if prompt[i] is not None:
                j.emit("prompt", prompt[i])
            if j.max_new == 0:
                self._finish(j, "done", "length")
        going = [i for i, j in enumerate(jobs) if j.max_new > 0]
        try:  # an error here would end the batcher's thread, and with it every request after this one
            picks = sample([jobs[i] for i in going], last[going]) if going else []
        except Exception as exc:
            for i in going:
                self._finish(jobs[i], "error", f"sampling failed: {type(exc).__name__}: {exc}")
            return
        for i, pick in zip(going, picks):
            jobs[i].position = len(jobs[i].ids)
            if self._take(jobs[i], pick):
                rows.append(jobs[i])
                keep.append(i)
        if rows:
            index = torch.tensor(keep)
            try:  # joining copies the batch's cache: memory can run out here too
                self.batches.setdefault(path, PathBatch(path, model)).add(rows, [(k[index], v[index]) for k, v in kv],
                                                                          mask[index])
            except Exception as exc:
                for j in rows:
                    self._finish(j, "error", f"joining the running batch failed: {type(exc).__name__}: {exc}")

    def _take(self, job: Job, pick: tuple[int, float, list]) -> bool:
        """Emit one sampled token; False when the job is done with it."""
        token, lp, top = pick
        job.generated += 1
        job.last = token
        job.emit("token", (token, lp, top))
        if self.metrics is not None:
            self.metrics.tokens(1)
        if token == self.eos:
            self._finish(job, "done", "stop")
            return False
        if job.generated >= job.max_new or (self.max_position is not None and job.position >= self.max_position):
            self._finish(job, "done", "length")
            return False
        return not self._drop_cancelled(job)

    def _decode(self) -> bool:
        worked = False
        for path, batch in list(self.batches.items()):
            batch.keep([i for i, j in enumerate(batch.jobs) if not self._drop_cancelled(j)])
            if not batch.jobs:
                del self.batches[path]
                continue
            try:  # sampling too: an error outside this would end the batcher's thread
                picks = sample(batch.jobs, batch.step())
            except Exception as exc:
                for j in batch.jobs:
                    self._finish(j, "error", f"the forward pass failed: {type(exc).__name__}: {exc}")
                del self.batches[path]
                continue
            if self.metrics is not None:
                self.metrics.decode_step(path, len(batch.jobs))
            keep = []
            for i, (j, pick) in enumerate(zip(batch.jobs, picks)):
                j.position += 1
                if self._take(j, pick):
                    keep.append(i)
            batch.keep(keep)
            if not batch.jobs:
                del self.batches[path]
            worked = True
        return worked

    def _drop_cancelled(self, job: Job) -> bool:
        if job.cancelled:
            self._finish(job, "done", "cancelled")
        return job.cancelled

    def _finish(self, job: Job, kind: str, payload) -> None:
        if job.pinned:
            job.pinned = False
            self.cache.pin(job.path, -1)
        job.cancelled = True  # never finished twice
        with self._count:
            self.in_flight -= 1
        job.emit(kind, payload)

    # ----------------------------------------------------------------- loading
    def _loader(self) -> None:
        while not self.stopping:
            path = self.loads.get()
            if not path:
                return
            while not self.stopping:
                try:
                    model = self.cache.load(path, pin=True)
                except Exception as exc:  # a damaged checkpoint: its requests fail with the reason
                    self.failed[path] = f"cannot load path {path}: {exc}"
                    break
                if model is not None:
                    with self._count:  # a path asked for twice (its jobs left and others came) is pinned once
                        if path in self.held:
                            self.cache.pin(path, -1)
                        else:
                            self.held.add(path)
                    self.blocked.discard(path)
                    break
                if not self.waiting.get(path):  # its jobs left while it waited for memory: stop holding others back
                    self.blocked.discard(path)
                    break
                self.blocked.add(path)  # everything resident is in use: wait for rows to finish
                time.sleep(0.02)
            self.wake.set()

    def _fail_path(self, path: str, message: str) -> None:
        self.blocked.discard(path)
        self._release(path)
        for j in self.waiting.pop(path, []):
            self._finish(j, "error", message)
