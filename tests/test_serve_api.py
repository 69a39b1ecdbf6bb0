"""The server's pure parts: OpenAI request checks, response shapes, stop strings, sizes, upstream lists, metrics."""

from __future__ import annotations

import pytest

from dipaco.errors import DipacoError
from dipaco.eval.serve.api import ApiError, chat_request, completion_logprobs, completion_request
from dipaco.eval.serve.choices import Text, tokens_in
from dipaco.eval.serve.engine import parse_bytes
from dipaco.eval.serve.metrics import Metrics
from dipaco.eval.serve.upstream import parse_upstreams


def test_prompts_take_every_form_openai_allows():
    assert completion_request({"model": "m", "prompt": "hi"}).prompts == ["hi"]
    assert completion_request({"model": "m", "prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert completion_request({"model": "m", "prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert completion_request({"model": "m", "prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    r = completion_request({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1, "stop": "\n",
                            "seed": 3, "n": 2, "temperature": 0, "best_of": 2})
    assert (r.sampling.max_tokens, r.sampling.echo, r.sampling.logprobs, r.sampling.stop, r.sampling.n) == (0, True, 1, ["\n"], 2)
    assert completion_request({"model": "m", "prompt": "x"}).sampling.temperature == 1.0  # OpenAI's default


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"), ({"model": "m"}, "prompt"), ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"), ({"model": "m", "prompt": [[]]}, "prompt"),
    ({"model": "m", "prompt": [True]}, "prompt"), ({"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"), ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "n": 17}, "n"), ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"), ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "stop": ""}, "stop"), ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"), ({"model": "m", "prompt": "x", "suffix": "!"}, "suffix"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"), ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
])
def test_bad_fields_are_400s_that_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        completion_request(body)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_requests():
    model, messages, s = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                       "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2})
    assert (model, s.max_tokens, s.logprobs) == ("m", 5, 2) and messages[0]["content"] == "hi"
    assert chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})[2].logprobs is None
    for bad in ({"model": "m", "messages": []}, {"model": "m", "messages": [{"role": "user"}]}, {"model": "m"}):
        with pytest.raises(ApiError):
            chat_request(bad)


def test_text_stops_at_the_first_stop_string_and_holds_back_what_could_start_one():
    pieces = {1: "Hel", 2: "lo wo", 3: "rld", 4: "\ufffd"}
    text = Text(lambda ids: "".join(pieces[i] for i in ids), ["wor", "ld!"])
    text.add(1)
    assert text.delta() == "H"  # the last two characters are kept back: with what follows they could form a stop
    text.add(2)
    assert not text.stopped and text.delta() == "ello "
    text.add(3)
    assert text.stopped and text.text == "Hello " and text.delta(final=True) == ""
    assert tokens_in(text, ["Hel", "lo wo", "rld"]) == 2
    half = Text(lambda ids: "".join(pieces[i] for i in ids), [])
    half.add(1), half.add(4)
    assert half.delta() == "Hel" and half.delta(final=True) == "\ufffd"


def test_logprobs_object_and_sizes_and_upstreams():
    lp = completion_logprobs(["ab", "c", "de"], [None, -1.0, -2.0], [None, [("c", -1.0)], [("x", -0.5)]])
    assert lp["text_offset"] == [0, 2, 3] and lp["top_logprobs"] == [None, {"c": -1.0}, {"x": -0.5}]
    assert parse_bytes("4GB") == 4 * 10**9 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    assert parse_bytes(None) > 0
    for bad in ("lots", "-1GB", "4XB"):
        with pytest.raises(DipacoError, match="max-memory"):
            parse_bytes(bad)
    assert parse_upstreams(["0-1=http://h:8000/v1/", "1-0 = https://g"], ["0-1", "1-0"]) == {"0-1": "http://h:8000",
                                                                                                "1-0": "https://g"}
    with pytest.raises(DipacoError, match="no path"):
        parse_upstreams(["9-9=http://h"], ["0-1"])
    with pytest.raises(DipacoError, match="PATH=URL"):
        parse_upstreams(["0-1=h:8000"], ["0-1"])


def test_metrics_render_prometheus_text():
    m = Metrics()
    m.request("/v1/completions", 200)
    m.decode_step("0-1", 3)
    m.prefill("0-1", 1, 7)
    m.gauge("dipaco_queue_depth", "choices in flight", lambda: 2)
    text = m.render()
    assert 'dipaco_requests_total{endpoint="/v1/completions",status="200"} 1' in text
    assert 'dipaco_batch_size_bucket{le="1"} 1' in text and 'dipaco_batch_size_bucket{le="4"} 2' in text
    assert "dipaco_batch_size_max 3" in text and "dipaco_queue_depth 2" in text and "dipaco_prompt_tokens_total 7" in text
    assert all(line.startswith("#") or len(line.split(" ")) == 2 for line in text.strip().splitlines())


def test_stop_strings_of_an_lm_eval_code_task_are_taken():
    """lm-eval's local-completions sends a task's every `until` plus the EOS, uncut: five or more for code tasks."""
    until = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|endoftext|>"]
    assert completion_request({"model": "m", "prompt": "def f():", "stop": until}).sampling.stop == until
