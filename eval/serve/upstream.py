"""The front router: route here, answer elsewhere.

With ``--upstream PATH=URL`` a path is served by another OpenAI-compatible server that holds that one exported path
(vLLM on a GPU machine, ``transformers serve``, or ``dipaco serve --model DIR``). The front router tokenizes and routes
as any dipaco server does, then forwards the request with the upstream's own model name, streaming included, and adds
which path answered and how it was routed. An upstream that does not answer gives its requests a 502 that names the
path; the other paths keep working.

A prefix-loss once rule scores a prompt's start with every path: through upstreams that is one ``echo`` +
``logprobs`` request per path (vLLM and dipaco answer it; ``transformers serve`` does not, so in front of it route with
``--routing shard``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dipaco.errors import DipacoError
from dipaco.eval.serve.api import ApiError


def parse_upstreams(items: list[str], paths: list[str]) -> dict[str, str]:
    """``PATH=URL`` items, or files of such lines (blank lines and ``#`` comments skipped): {path: base URL}."""
    pairs: list[str] = []
    for item in items:
        if "=" not in item and Path(item).is_file():
            pairs += [line.strip() for line in Path(item).read_text().splitlines()
                      if line.strip() and not line.strip().startswith("#")]
        else:
            pairs.append(item)
    out = {}
    for pair in pairs:
        path, _, url = pair.partition("=")
        path, url = path.strip(), url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise DipacoError(f"--upstream {pair!r}: write PATH=URL with an http(s) URL, e.g. 0-1=http://10.0.0.5:8000, "
                              f"or give a file of such lines")
        if path not in paths:
            raise DipacoError(f"--upstream {pair!r}: the run has no path {path!r}; paths: {', '.join(paths)}")
        out[path] = url[:-3] if url.endswith("/v1") else url
    return out


class Upstreams:
    def __init__(self, urls: dict[str, str], timeout: float = 600.0):
        import httpx

        self.urls, self.httpx = urls, httpx
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))
        self._models: dict[str, str] = {}

    def serves(self, path: str) -> bool:
        return path in self.urls

    def url_of(self, path: str) -> str | None:
        return self.urls.get(path)

    async def _model(self, path: str) -> str:
        if path not in self._models:
            r = await self.client.get(f"{self.urls[path]}/v1/models")
            r.raise_for_status()
            self._models[path] = r.json()["data"][0]["id"]
        return self._models[path]

    def _down(self, path: str, exc: Exception) -> ApiError:
        return ApiError(502, f"path {path} is served by {self.urls[path]}, which did not answer "
                             f"({type(exc).__name__}: {exc}); other paths are unaffected", kind="upstream_error",
                        code="upstream_unavailable")

    async def forward(self, body: dict, endpoint: str, path: str, how: str):
        """Forward ``body`` to the path's upstream: (status, JSON or None, an async line iterator for a stream)."""
        try:
            body = dict(body, model=await self._model(path))
            request = self.client.build_request("POST", f"{self.urls[path]}{endpoint}", json=body)
            response = await self.client.send(request, stream=bool(body.get("stream")))
        except (self.httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise self._down(path, exc) from None
        if not body.get("stream") or response.status_code != 200:
            await response.aread()
            try:
                payload = response.json()
            except ValueError:
                payload = {"error": {"message": response.text[:500], "type": "upstream_error"}}
            await response.aclose()
            if response.status_code == 200:
                for c in payload.get("choices", []):
                    c.update(path=path, routing=how)
            return response.status_code, payload, None
        return 200, None, self._lines(response, path, how)

    async def _lines(self, response, path: str, how: str):
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for c in chunk.get("choices", []):
                        c.update(path=path, routing=how)
                    yield f"data: {json.dumps(chunk)}\n\n"
                elif line.startswith("data:"):
                    yield line + "\n\n"
        except self.httpx.HTTPError as exc:  # the upstream died mid-answer: end the stream with an error event
            yield f"data: {json.dumps(self._down(path, exc).body())}\n\n"
        finally:
            await response.aclose()

    def score(self, requests: list[tuple[str, list[int]]]) -> list[np.ndarray]:
        """Every target's NLL of each (path, ids) from the path's upstream (echo + logprobs, no new token). Called by
        routing on a worker thread, so it uses a blocking client of its own."""
        out = []
        with self.httpx.Client(timeout=self.httpx.Timeout(600.0, connect=5.0)) as client:
            for path, ids in requests:
                try:
                    model = client.get(f"{self.urls[path]}/v1/models").json()["data"][0]["id"]
                    r = client.post(f"{self.urls[path]}/v1/completions", json={
                        "model": model, "prompt": list(ids), "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0})
                    values = r.json()["choices"][0]["logprobs"]["token_logprobs"] if r.status_code == 200 else []
                except (self.httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
                    raise self._down(path, exc) from None
                if len(values) != len(ids):
                    raise ApiError(502, f"the upstream of path {path} cannot score a prompt (HTTP {r.status_code}); serve "
                                        f"it with vLLM or dipaco serve --model, or route with --routing shard",
                                   kind="upstream_error")
                out.append(-np.array(values[1:], dtype=np.float64))
        return out

    async def close(self) -> None:
        await self.client.aclose()
