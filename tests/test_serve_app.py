"""The HTTP layer alone, in process: a fake engine (one character a token, jobs answered by a thread) behind the real
``Server``, so cancellation and queue places on error paths are checked in milliseconds."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

from starlette.testclient import TestClient

from dipaco.eval.serve.app import Server
from dipaco.eval.serve.metrics import Metrics


class CharTokenizer:
    chat_template = "plain"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """Paths 'a' and 'b'; a prompt starting with '!' fails in the batcher, others get 'x' every 10 ms."""

    name, paths, route_every, routing, max_len, budget = "m", ["a", "b"], 0, "run", 100_000, 1

    def __init__(self):
        self.tokenizer, self.ends, self.seeds = CharTokenizer(), [], []
        self.source = SimpleNamespace(config=SimpleNamespace(vocab_size=256))
        self.batcher = SimpleNamespace(in_flight=0)
        self.cache = SimpleNamespace(resident_bytes=0, parameter_bytes=lambda: 0, models={})

    def routing_cost(self):
        return "none"

    def route(self, ids):
        return ("b" if ids[0] == ord("b") else "a"), "test"

    def submit(self, job):
        self.seeds.append(job.seed)
        threading.Thread(target=self._run, args=(job,), daemon=True).start()

    def _run(self, job):
        if job.ids[0] == ord("!"):
            self.ends.append("error")
            return job.emit("error", "boom")
        for _ in range(job.max_new):
            if job.cancelled:
                self.ends.append("cancelled")
                return job.emit("done", "cancelled")
            job.emit("token", (ord("x"), -0.5, []))
            time.sleep(0.01)
        self.ends.append("length")
        job.emit("done", "length")


def _server():
    engine = FakeEngine()
    return engine, Server(engine, Metrics(), max_queue=8)


def _settle(engine, n, timeout=5.0):
    deadline = time.time() + timeout
    while len(engine.ends) < n and time.time() < deadline:
        time.sleep(0.01)


def test_a_failed_choice_stops_its_siblings_and_frees_the_queue():
    engine, server = _server()
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["!x", "hello"], "max_tokens": 500})
        _settle(engine, 2)
    assert r.status_code == 500 and r.json()["error"]["message"] == "boom"
    assert sorted(engine.ends) == ["cancelled", "error"]  # the other choice's row left at once, not after 500 tokens
    assert server.pending == 0


def test_a_stream_whose_client_left_before_it_began_frees_its_queue_places():
    """The client goes while the response's first message is being written: Starlette cancels the stream before its
    generator ever runs, so the generator's own cleanup never runs; the queue places must still come back."""
    engine, server = _server()
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True, "n": 3}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0.1)  # a slow socket

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "root_path": "",
             "scheme": "http", "server": ("test", 80), "client": ("test", 1)}
    asyncio.run(server.app(scope, receive, send))
    assert server.pending == 0


def _events(response) -> list:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_a_choice_that_fails_mid_stream_sends_an_error_event():
    """OpenAI's clients raise on an ``error`` event; a finish_reason of "error: ..." (not one of OpenAI's) went by
    unnoticed, and chat's stream broke on the event an upstream sends."""
    engine, server = _server()
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["!x", "hi"], "max_tokens": 3, "stream": True})
        chat = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "!"}],
                                                         "stream": True})
    events = _events(r)
    assert {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}} in events
    assert {c["finish_reason"] for e in events for c in e.get("choices", [])} <= {None, "length", "stop"}
    assert r.text.endswith("data: [DONE]\n\n") and server.pending == 0
    assert chat.status_code == 200 and [e["error"]["message"] for e in _events(chat)] == ["boom"]


def test_the_n_choices_of_a_seeded_request_are_n_samples():
    """With a seed, every choice sampled with the same generator: n > 1 gave n copies of one answer."""
    engine, server = _server()
    with TestClient(server.app) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 1, "n": 3,
                                                     "seed": 5, "temperature": 1, "stream": stream})
            assert r.status_code == 200
    first, second = engine.seeds[:6], engine.seeds[6:]
    assert sorted(first) == sorted(second) and first.count(5) == 2 and len(set(first)) == 3  # as many as n


def test_a_front_router_answers_prompts_of_its_own_paths_next_to_forwarded_ones():
    """Several prompts, some routed to a path served upstream and some to a path served here (the docs: paths without
    an upstream are served locally): the local ones were sent to the upstreams too, a KeyError and a bare 500."""
    import httpx

    from dipaco.eval.serve.upstream import Upstreams

    def upstream(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "up"}]})
        body = json.loads(request.content)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "up:" + body["prompt"], "finish_reason": "length",
                                                      "logprobs": None}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})

    engine = FakeEngine()
    ups = Upstreams({"b": "http://upstream-b"})
    ups.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    server = Server(engine, Metrics(), max_queue=8, upstreams=ups)
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["aa", "bb"], "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [(c["index"], c["text"], c["path"], c["routing"]) for c in choices] == [
        (0, "xx", "a", "test"), (1, "xx", "a", "test"), (2, "up:bb", "b", "test")]
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert server.pending == 0


def test_a_request_larger_than_the_queue_is_a_400_not_a_429():
    """A 429 says "retry shortly" (Retry-After), but a request of more choices than the queue holds never fits."""
    engine, server = _server()
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 1, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 4}).status_code == 200


def test_every_choice_of_a_chat_stream_begins_with_the_role():
    """OpenAI names the role in each choice's first delta; only the stream's very first chunk had it (n > 1)."""
    engine, server = _server()
    with TestClient(server.app) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "n": 3, "stream": True})
    first = {}
    for e in _events(r):
        for c in e["choices"]:
            first.setdefault(c["index"], c["delta"])
    assert first == {i: {"role": "assistant", "content": "x"} for i in range(3)}
