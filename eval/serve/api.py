"""OpenAI's request and response shapes, checked and built without a server (pure functions, unit-tested).

Every bad request becomes an ``ApiError``: an HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    logprobs: int | None = None  # completions: top alternatives per token; chat: top_logprobs when logprobs is true
    echo: bool = False


@dataclass
class CompletionRequest:
    model: str
    prompts: list  # each a str or a list of token ids
    sampling: Sampling


MAX_N = 16
MAX_LOGPROBS = 20
# OpenAI takes 4, but lm-eval's local-completions sends a task's every `until` and the EOS, uncut (vLLM takes any)
MAX_STOPS = 16


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{key}' is {value}; it must be between {lo} and {hi}", key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false, got {value!r}", key)
    return value


def _unsupported(body: dict) -> None:
    """Options this server does not implement: refused rather than silently ignored."""
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise ApiError(400, f"'{key}' is not supported by dipaco serve; leave it out or set it to 0", key)
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by dipaco serve; leave it out", "logit_bias")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' (insertion) is not supported by dipaco serve; leave it out", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ApiError(400, "'best_of' is not supported by dipaco serve; use 'n'", "best_of")


def sampling_of(body: dict, max_tokens_key: str = "max_tokens", default_max: int = 16) -> Sampling:
    _unsupported(body)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    max_tokens = body.get(max_tokens_key, body.get("max_tokens"))
    return Sampling(
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", default_max, 0, 1 << 20, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_p=float(_number(body, "top_p", 1.0, 1e-9, 1)),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        stop=stop, n=_number(body, "n", 1, 1, MAX_N, integer=True), stream=_flag(body, "stream"))


def _model_of(body) -> str:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: a model name from GET /v1/models", "model")
    return model


def completion_request(body) -> CompletionRequest:
    """A /v1/completions body, checked."""
    model = _model_of(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
          and all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p)):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                            "lists (none empty)", "prompt")
    sampling = sampling_of(body)
    sampling.logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    sampling.echo = _flag(body, "echo")
    if sampling.max_tokens == 0 and not sampling.echo:
        raise ApiError(400, "'max_tokens' is 0 without 'echo': nothing to return; ask for tokens or set echo", "max_tokens")
    return CompletionRequest(model, prompts, sampling)


def chat_request(body) -> tuple[str, list[dict], Sampling]:
    """A /v1/chat/completions body, checked: (model, messages, sampling)."""
    model = _model_of(body)
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects with text content", "messages")
    sampling = sampling_of(body, "max_completion_tokens", default_max=256)
    if _flag(body, "logprobs"):
        sampling.logprobs = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    if sampling.max_tokens == 0:
        raise ApiError(400, "'max_tokens' must be at least 1 for a chat completion", "max_tokens")
    return model, messages, sampling


# ------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_logprobs(pieces: list[str], logprobs: list[float | None], top: list[list[tuple[str, float]] | None],
                        start: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object: token strings, their log-probabilities (None for a prompt's first
    token, which nothing predicts), the top alternatives as {token: logprob}, and each token's offset in the text."""
    offsets, at = [], start
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": logprobs,
            "top_logprobs": [None if t is None else dict(t) for t in top], "text_offset": offsets}


def chat_logprobs(pieces: list[str], logprobs: list[float], top: list[list[tuple[str, float]]]) -> dict:
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts]}
                        for p, lp, alts in zip(pieces, logprobs, top)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, rid: str, model: str, choices: list[dict], extra: dict) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}
