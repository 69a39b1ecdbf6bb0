"""The HTTP server: OpenAI's API over an ``Engine`` (a routed run, or one Hugging Face directory), optionally in front
of upstream servers that each serve one exported path.

    GET  /health               liveness
    GET  /v1/models            NAME (routed) and NAME/PATH (pinned) for every path
    POST /v1/completions       prompts as text or token ids; stream, n, stop, seed, logprobs, echo
    POST /v1/chat/completions  where the tokenizer has a chat template (else 400)
    GET  /metrics              Prometheus text

Every completion says which path answered and how it was routed: ``path`` and ``routing`` in each choice, and the
``X-Dipaco-Path`` / ``X-Dipaco-Routing`` headers (the first prompt's, for a request of several).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dipaco.eval.serve import api
from dipaco.eval.serve.api import ApiError
from dipaco.eval.serve.choices import Text, choice_events, choice_seed, tokens_in

log = logging.getLogger("dipaco.serve")


class Server:
    def __init__(self, engine, metrics, api_key: str | None = None, max_queue: int = 256, upstreams=None):
        self.engine, self.metrics, self.api_key, self.max_queue = engine, metrics, api_key, max_queue
        self.upstreams = upstreams
        self.pending = 0  # choices accepted and not finished (routing included)
        self.closing = False
        metrics.gauge("dipaco_queue_depth", "choices accepted and not finished", lambda: self.pending)
        metrics.gauge("dipaco_batcher_jobs", "jobs in the batcher, waiting or running", lambda: engine.batcher.in_flight)
        metrics.gauge("dipaco_resident_module_bytes", "bytes of the modules held in memory",
                      lambda: engine.cache.resident_bytes)
        metrics.gauge("dipaco_resident_parameter_bytes", "bytes of the distinct tensors the resident paths use",
                      engine.cache.parameter_bytes)
        metrics.gauge("dipaco_memory_budget_bytes", "the --max-memory budget for modules", lambda: engine.budget)
        metrics.gauge("dipaco_resident_paths", "paths assembled from resident modules", lambda: len(engine.cache.models))
        self.app = Starlette(routes=[
            Route("/health", self.health), Route("/v1/models", self.models), Route("/metrics", self.scrape),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"])])

    # ------------------------------------------------------------------ plumbing
    def _check(self, request: Request) -> None:
        if self.api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                               kind="authentication_error", code="invalid_api_key")
        if self.closing:
            raise ApiError(503, "the server is shutting down", kind="server_error", headers={"Retry-After": "5"})

    def _error(self, endpoint: str, exc: ApiError) -> Response:
        log.warning("%s %d: %s", endpoint, exc.status, exc.message)
        self.metrics.request(endpoint, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def _body(self, request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None

    def resolve(self, model: str) -> str | None:
        """The pinned path of a model name (None: routed); an unknown name is a 404."""
        name = self.engine.name
        if model == name:
            return None
        if model.startswith(name + "/"):
            path = model[len(name) + 1:]
            if path in self.engine.paths:
                return path
            raise ApiError(404, f"model {model!r}: {name} has no path {path!r}; paths: {', '.join(self.engine.paths)}",
                           "model", "model_not_found")
        raise ApiError(404, f"model {model!r} does not exist; this server serves {name} (routed) and {name}/PATH "
                            f"(pinned); see GET /v1/models", "model", "model_not_found")

    def _reserve(self, n: int) -> None:
        if n > self.max_queue:  # it never fits: a 429 would have clients (Retry-After) send it again forever
            raise ApiError(400, f"{n} choices (prompts times n) are more than --max-queue {self.max_queue}", "n")
        if self.pending + n > self.max_queue:
            raise ApiError(429, f"the server is busy ({self.pending} choices in flight, at most {self.max_queue}); "
                                f"retry shortly", kind="rate_limit_error", headers={"Retry-After": "1"})
        self.pending += n

    # ------------------------------------------------------------------ small endpoints
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.name})

    async def models(self, request: Request) -> Response:
        try:
            self._check(request)
        except ApiError as exc:
            return self._error("/v1/models", exc)
        data = [{"id": self.engine.name, "object": "model", "owned_by": "dipaco", "paths": self.engine.paths,
                 "routing": self.engine.routing_cost()}]
        data += [{"id": f"{self.engine.name}/{p}", "object": "model", "owned_by": "dipaco", "path": p,
                  "upstream": self.upstreams.url_of(p) if self.upstreams else None} for p in self.engine.paths]
        self.metrics.request("/v1/models", 200)
        return JSONResponse({"object": "list", "data": data})

    async def scrape(self, request: Request) -> Response:
        try:
            self._check(request)
        except ApiError as exc:
            return self._error("/metrics", exc)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ completions
    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def _piece(self, token: int) -> str:
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    def _prompt_ids(self, prompt, s: api.Sampling) -> list[int]:
        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = int(self.engine.source.config.vocab_size)
        if not ids:
            raise ApiError(400, "the prompt is empty (zero tokens); give some text to continue", "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"the prompt holds token ids outside the vocabulary (0 to {vocab - 1})", "prompt")
        if len(ids) + s.max_tokens > self.engine.max_len:
            raise ApiError(400, f"this model's context is {self.engine.max_len} tokens; the prompt has {len(ids)} and "
                                f"max_tokens asks for {s.max_tokens} more: shorten the prompt or lower max_tokens",
                           "prompt", "context_length_exceeded")
        return ids

    async def _route(self, ids: list[int], pinned: str | None) -> tuple[str, str]:
        if pinned is not None:
            return pinned, "pinned by the model name"
        return await asyncio.to_thread(self.engine.route, ids)

    async def completions(self, request: Request) -> Response:
        endpoint = "/v1/completions"
        try:
            self._check(request)
            raw = await self._body(request)
            req = api.completion_request(raw)
            pinned = self.resolve(req.model)
            ids = [self._prompt_ids(p, req.sampling) for p in req.prompts]
            self._reserve(len(ids) * req.sampling.n)
        except ApiError as exc:
            return self._error(endpoint, exc)
        reserved = len(ids) * req.sampling.n
        try:
            routes = [await self._route(x, pinned) for x in ids]
        except Exception as exc:
            self.pending -= reserved
            return self._error(endpoint, exc if isinstance(exc, ApiError) else ApiError(500, f"routing failed: {exc}",
                                                                                        kind="server_error"))
        for path, _ in routes:
            self.metrics.path_request(path)
        headers = {"X-Dipaco-Path": ",".join(dict.fromkeys(p for p, _ in routes)), "X-Dipaco-Routing": routes[0][1]}
        if self.upstreams is not None and any(self.upstreams.serves(p) for p, _ in routes):
            self.pending -= reserved
            return await self._forward(request, raw, req, routes, headers, endpoint)
        rid = api.new_id("cmpl")
        runs = [(i * req.sampling.n + k, x, p, how, req.prompts[i])
                for i, (x, (p, how)) in enumerate(zip(ids, routes)) for k in range(req.sampling.n)]
        if req.sampling.stream:
            release = _once(lambda: setattr(self, "pending", self.pending - reserved))
            return ClosingStream(self._stream(rid, req.model, runs, req.sampling, release, endpoint),
                                 media_type="text/event-stream", headers=headers, release=release)
        try:
            choices = await self._gather(request, runs, req.sampling)
        except ApiError as exc:
            return self._error(endpoint, exc)
        finally:
            self.pending -= reserved
        if choices is None:  # the client left: nobody to answer
            self.metrics.request(endpoint, 499)
            return Response(status_code=499)
        used = api.usage(sum(len(x) for x in ids), sum(c.pop("_new") for c in choices))
        self.metrics.request(endpoint, 200)
        return JSONResponse(api.envelope("text_completion", rid, req.model, choices, {"usage": used}), headers=headers)

    async def _forward(self, request, raw: dict, req, routes, headers: dict, endpoint: str) -> Response:
        """Requests routed to paths served upstream: forwarded whole when every prompt has the same path, else one
        forward per prompt (or, for a path without an upstream, an answer from here), merged (not while streaming)."""
        try:
            if len(set(routes)) == 1:
                status, payload, lines = await self.upstreams.forward(raw, endpoint, *routes[0])
                if lines is not None:
                    self.metrics.request(endpoint, 200)
                    return ClosingStream(lines, media_type="text/event-stream", headers=headers)
                self.metrics.request(endpoint, status)
                return JSONResponse(payload, status_code=status, headers=headers)
            if req.sampling.stream:
                raise ApiError(400, "these prompts go to different paths served upstream; stream one prompt per request",
                               "prompt")
            answers = await asyncio.gather(*(self._answer(request, dict(raw, prompt=p), endpoint, *r)
                                             for p, r in zip(req.prompts, routes)))
        except ApiError as exc:
            return self._error(endpoint, exc)
        bad = next(((s, body) for s, body, _ in answers if s != 200), None)
        if bad:
            self.metrics.request(endpoint, bad[0])
            return JSONResponse(bad[1], status_code=bad[0], headers=headers)
        choices = []
        for i, (_, body, _) in enumerate(answers):
            for c in body["choices"]:
                choices.append(c | {"index": i * req.sampling.n + c.get("index", 0)})
        used = api.usage(*(sum((b.get("usage") or {}).get(k, 0) for _, b, _ in answers)
                           for k in ("prompt_tokens", "completion_tokens")))
        self.metrics.request(endpoint, 200)
        return JSONResponse(api.envelope("text_completion", api.new_id("cmpl"), req.model, choices, {"usage": used}),
                            headers=headers)

    async def _answer(self, request, body: dict, endpoint: str, path: str, how: str):
        if self.upstreams.serves(path):
            return await self.upstreams.forward(body, endpoint, path, how)
        # a prompt of this request routed to a path served here, not by an upstream: answered by this server
        r = await self.completions(_Rebodied(request, dict(body, model=f"{self.engine.name}/{path}")))
        out = json.loads(r.body or b"{}")
        for c in out.get("choices", []):
            c["routing"] = how
        return r.status_code, out, None

    async def _gather(self, request: Request, runs, s: api.Sampling) -> list[dict] | None:
        """Every choice to its end; None if the client disconnects first (its rows are freed)."""
        tasks = [asyncio.create_task(self._one_choice(*run, s)) for run in runs]
        everything = asyncio.gather(*tasks)
        watcher = asyncio.create_task(_wait_for_disconnect(request))
        done, _ = await asyncio.wait([everything, watcher], return_when=asyncio.FIRST_COMPLETED)
        if everything not in done:
            everything.cancel()
            await asyncio.gather(everything, return_exceptions=True)
            return None
        watcher.cancel()
        failed = everything.exception()
        if failed is not None:  # gather leaves the other choices running: stop them, so their rows leave too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not isinstance(failed, ApiError):
                raise ApiError(500, f"{type(failed).__name__}: {failed}", kind="server_error") from failed
        return everything.result()

    async def _one_choice(self, index: int, ids: list[int], path: str, how: str, prompt, s: api.Sampling) -> dict:
        text, prompt_lp, new = Text(self._decode, s.stop), None, []
        reason = "length"
        events = choice_events(self.engine, ids, path, s, choice_seed(s, index), rerouted=how != "pinned by the model name")
        try:
            async for kind, payload in events:
                if kind == "prompt":
                    prompt_lp = payload
                elif kind == "token":
                    new.append(payload)
                    text.add(payload[0])
                    if text.stopped:
                        reason = "stop"
                        break
                else:
                    reason = payload
        finally:
            await events.aclose()
        echo = (prompt if isinstance(prompt, str) else self._decode(ids)) if s.echo else ""
        choice = {"index": index, "text": echo + text.text, "finish_reason": reason, "logprobs": None,
                  "path": path, "routing": how, "_new": len(new)}
        if len(dict.fromkeys(p for *_, p in new)) > 1:
            choice["segments"] = _segments([p for *_, p in new])
        if s.logprobs is not None:
            pieces = [self._piece(t) for t, *_ in new]
            keep = tokens_in(text, pieces)
            lps = [lp for _, lp, _, _ in new][:keep]
            tops = [self._top(t, top, lp) for t, lp, top, _ in new][:keep]
            if s.echo:
                prompt_pieces = [self._piece(t) for t in ids]
                lps = [None] + [lp for lp, _ in prompt_lp] + lps
                tops = [None] + [self._top(t, top, lp) for t, (lp, top) in zip(ids[1:], prompt_lp)] + tops
                pieces = prompt_pieces + pieces[:keep]
            else:
                pieces = pieces[:keep]
            choice["logprobs"] = api.completion_logprobs(pieces, lps, tops)
        return choice

    def _top(self, token: int, top, lp: float) -> list[tuple[str, float]]:
        """The top alternatives with the chosen token among them (as vLLM answers), keyed by their text."""
        out = [(self._piece(t), v) for t, v in top]
        piece = self._piece(token)
        return out if any(p == piece for p, _ in out) else out + [(piece, lp)]

    async def _stream(self, rid: str, model: str, runs, s: api.Sampling, release, endpoint: str):
        """Server-sent events: one chunk per piece of text of any choice, as it comes; then ``data: [DONE]``."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index, ids, path, how, prompt):
            text, reason = Text(self._decode, s.stop), "length"
            events = choice_events(self.engine, ids, path, s, choice_seed(s, index), rerouted=how != "pinned by the model name")
            try:
                if s.echo:
                    await queue.put((index, prompt if isinstance(prompt, str) else self._decode(ids), None, path, how))
                async for kind, payload in events:
                    if kind == "token":
                        text.add(payload[0])
                        if text.stopped:
                            reason = "stop"
                            break
                        await queue.put((index, text.delta(), None, payload[3], how))
                    elif kind == "done":
                        reason = payload
            except Exception as exc:  # an error event, which OpenAI's clients raise (finish_reason has no "error")
                reason = exc if isinstance(exc, ApiError) else ApiError(500, f"{type(exc).__name__}: {exc}",
                                                                         kind="server_error")
            finally:
                await events.aclose()
                await queue.put((index, text.delta(final=True), reason, path, how))

        tasks = [asyncio.create_task(pump(*run)) for run in runs]
        left = len(tasks)
        try:
            while left:
                index, delta, reason, path, how = await queue.get()
                if reason is not None:
                    left -= 1
                if isinstance(reason, ApiError):
                    yield f"data: {json.dumps(reason.body())}\n\n"
                    continue
                if not delta and reason is None:
                    continue
                choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": reason, "path": path,
                          "routing": how}
                chunk = api.envelope("text_completion", rid, model, [choice], {})
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
            self.metrics.request(endpoint, 200)
        finally:  # the client left, or we are done: stop every choice still running. No await here: when the client
            # left, this runs inside a cancelled task group, where any await is cancelled again at once
            release()
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request) -> Response:
        endpoint = "/v1/chat/completions"
        try:
            self._check(request)
            model, messages, s = api.chat_request(await self._body(request))
            self.resolve(model)
            if not getattr(self.engine.tokenizer, "chat_template", None):
                raise ApiError(400, f"{self.engine.name}'s tokenizer has no chat template, so it cannot take chat "
                                    f"messages; use POST /v1/completions with a prompt", "messages")
            prompt = self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except ApiError as exc:
            return self._error(endpoint, exc)
        body = {"model": model, "prompt": prompt, "max_tokens": s.max_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "seed": s.seed, "stop": s.stop or None, "n": s.n, "stream": s.stream,
                "logprobs": s.logprobs}
        return await self._as_chat(request, body, endpoint)

    async def _as_chat(self, request: Request, body: dict, endpoint: str) -> Response:
        """A chat request answered as the completion of its templated prompt, reshaped into chat's objects."""
        inner = _Rebodied(request, body)
        response = await self.completions(inner)
        if isinstance(response, StreamingResponse) or response.status_code != 200:
            if isinstance(response, StreamingResponse):
                response.body_iterator = _chat_chunks(response.body_iterator)
            return response
        out = json.loads(response.body)
        for c in out["choices"]:
            lp = c.pop("logprobs")
            c["message"] = {"role": "assistant", "content": c.pop("text")}
            c["logprobs"] = None if lp is None else api.chat_logprobs(
                lp["tokens"], lp["token_logprobs"], [list(t.items())[:body["logprobs"]] for t in lp["top_logprobs"]])
        out["object"], out["id"] = "chat.completion", out["id"].replace("cmpl", "chatcmpl")
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("x-dipaco")}
        return JSONResponse(out, headers=headers)


class ClosingStream(StreamingResponse):
    """A stream whose generator is always closed, also when the client leaves mid-way (Starlette stops iterating
    then, and a generator left suspended would hold its rows and queue places until garbage collection). ``release``
    gives back the queue places also when the client left before the generator ever ran (closing a generator that
    never started runs none of its code)."""

    def __init__(self, *args, release=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.release is not None:
                self.release()
            await self.body_iterator.aclose()


def _once(fn):
    """``fn`` that runs the first time it is called only."""
    called = []
    return lambda: None if called else (called.append(True), fn())


class _Rebodied(Request):
    """The same request (headers, connection) with another JSON body."""

    def __init__(self, request: Request, body: dict):
        super().__init__(request.scope, request.receive)
        self._body = json.dumps(body).encode()


async def _chat_chunks(chunks):
    named = set()  # choices whose first delta (the one that carries the role) was sent
    try:
        async for line in chunks:
            if not line.startswith("data: {"):
                yield line
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # an error event (ours, or an upstream's) has no choices to reshape
                yield line
                continue
            chunk["object"], chunk["id"] = "chat.completion.chunk", chunk["id"].replace("cmpl", "chatcmpl")
            for c in chunk["choices"]:
                text = c.pop("text")
                c.pop("logprobs", None)
                c["delta"] = ({} if c["index"] in named else {"role": "assistant"}) | ({"content": text} if text else {})
                named.add(c["index"])
            yield f"data: {json.dumps(chunk)}\n\n"
    finally:
        await chunks.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


def _segments(paths: list[str]) -> list[dict]:
    out: list[dict] = []
    for p in paths:
        if out and out[-1]["path"] == p:
            out[-1]["tokens"] += 1
        else:
            out.append({"path": p, "tokens": 1})
    return out
