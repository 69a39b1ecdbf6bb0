"""One choice of a completion, on the event loop: its jobs' events, re-routing every W tokens, stop strings, text.

``choice_events`` turns a prompt's path and options into events (``prompt``, ``token``, ``done``), running one batcher
job per segment (a segment is W new tokens under ``--route-every W``, else the whole answer). ``Text`` turns tokens
into the text a client sees: decoded as ``dipaco generate`` decodes, cut at the first stop string, and, while
streaming, holding back what might still become a stop string or is half of a character.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from dipaco.eval.serve.api import ApiError, Sampling
from dipaco.eval.serve.batcher import Job


async def job_events(engine, job: Job, eager: bool = True):
    """The events of one batcher job; a consumer that stops early cancels the job (its row leaves the batch at the next
    step). ``eager``: the event loop is woken for every token (a stream, stop strings to watch); otherwise tokens are
    collected on the batcher's side and handed over with the job's end, so a plain request costs the loop one wake-up
    instead of one per token."""
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()
    events: collections.deque = collections.deque()

    def emit(kind, payload):
        events.append((kind, payload))  # deque appends and pops are thread-safe
        if eager or kind != "token":
            loop.call_soon_threadsafe(arrived.set)

    job.emit = emit
    engine.submit(job)
    try:
        while True:
            await arrived.wait()
            arrived.clear()
            while events:
                kind, payload = events.popleft()
                yield kind, payload
                if kind in ("done", "error"):
                    return
    finally:
        job.cancelled = True


def choice_seed(s: Sampling, index: int) -> int | None:
    """The seed of choice ``index`` (prompt i's k-th of n is i * n + k): the request's for each prompt's first choice,
    then one apart by 2**32 (segments take seed + 1, + 2, ...), so the n choices of a seeded request are n samples,
    not one repeated n times."""
    return None if s.seed is None else s.seed + ((index % s.n) << 32)


async def choice_events(engine, ids: list[int], path: str, s: Sampling, seed: int | None, rerouted: bool):
    """Events of one choice: ``("prompt", [(logprob, top)])`` (echo with logprobs), ``("token", (id, logprob, top,
    path))`` per new token and ``("done", reason)``. With ``rerouted``, every W new tokens the run's every-W rule picks
    the next segment's path, which reads the whole text so far (as ``dipaco generate --route-every`` does)."""
    context, first, spans, left = list(ids), path, [], s.max_tokens
    every = engine.route_every if rerouted else 0
    while True:
        n = min(every or left, left)
        job = Job(path, context, n, None, temperature=s.temperature, top_p=s.top_p,
                  seed=None if seed is None else seed + len(spans), top_logprobs=s.logprobs or 0,
                  prompt_logprobs=s.echo and s.logprobs is not None and not spans)
        reason, made = "length", 0
        async for kind, payload in job_events(engine, job, eager=s.stream or bool(s.stop)):
            if kind == "prompt":
                yield "prompt", payload
            elif kind == "token":
                made += 1
                context.append(payload[0])
                yield "token", (*payload, path)
            elif kind == "error":
                raise ApiError(500, str(payload), kind="server_error")
            else:
                reason = payload
        spans.append(made)
        left -= made
        if reason != "length" or left <= 0 or not every:
            yield "done", reason
            return
        path = await asyncio.to_thread(engine.next_path, context, first, path, spans)


@dataclass
class Text:
    """The text of a choice's new tokens, cut at the first stop string. Decoded when read, or at every token when
    stop strings must be watched for."""
    decode: object
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    sent: int = 0
    stopped: bool = False
    _text: str = ""
    _decoded: int = 0  # how many ids _text holds

    @property
    def text(self) -> str:
        if self._decoded != len(self.ids) and not self.stopped:
            self._text, self._decoded = self.decode(self.ids), len(self.ids)
        return self._text

    def add(self, token: int) -> None:
        self.ids.append(token)
        if not self.stops:
            return
        text = self.text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._text, self.stopped = text[:min(hits)], True

    def delta(self, final: bool = False) -> str:
        """Text not sent yet; before the end, keep back a tail that could begin a stop string or ends mid-character."""
        text = self.text
        end = len(text)
        if not final:
            end -= max((len(s) - 1 for s in self.stops), default=0)
            while end > self.sent and text[end - 1:end] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out


def tokens_in(text: Text, pieces: list[str]) -> int:
    """How many new tokens the (possibly stop-cut) text still covers: their logprobs are kept, the rest dropped."""
    if not text.stopped:
        return len(pieces)
    at = 0
    for i, piece in enumerate(pieces):
        if at >= len(text.text):
            return i
        at += len(piece)
    return len(pieces)
