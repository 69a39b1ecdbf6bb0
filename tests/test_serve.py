"""``dipaco serve`` for real: a server process on a free loopback port, talked to with the official ``openai`` client.

One server of the session's tiny 2x2 run answers most tests; the memory budget, the API key, the queue bound and the
front router each start their own.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dipaco.eval.api import load
from dipaco.eval.generate import generate, loaded_scorer, route_ids, route_prompt

from eval_helpers import private_run
from serve_helpers import ServerProcess

openai = pytest.importorskip("openai", reason="the serving tests use the openai client: pip install -e '.[test]'")
pytestmark = pytest.mark.slow  # a trained run and server processes

PROMPTS = ["def main():\n    return", "The history of the", "import numpy as np\n", "Chapter 1. It was",
           "class Config:\n", "In the beginning", "SELECT name FROM", "Once upon a time"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, shards_2x2):
    return private_run(tmp_path_factory, shards_2x2)


@pytest.fixture(scope="module")
def rr(run):
    return load(run, progress=False)


@pytest.fixture(scope="module")
def server(run):
    s = ServerProcess("--run", str(run), "--name", "tiny")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_completion_equals_generate_and_names_its_path(client, rr):
    for prompt in PROMPTS[:4]:
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        answer = raw.parse()
        expected = generate(rr, prompt, max_new_tokens=12)
        path, how, _ = route_prompt(rr, prompt)
        choice = answer.choices[0].model_dump()
        assert choice["text"] == expected.text
        assert choice["path"] == path == expected.paths[0][0] and choice["routing"] == how
        assert raw.headers["x-dipaco-path"] == path and raw.headers["x-dipaco-routing"] == how
        assert answer.usage.completion_tokens == expected.new_tokens


def test_stream_pinned_path_and_several_prompts(client, rr):
    whole = client.completions.create(model="tiny/1-0", prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert whole.choices[0].model_dump()["path"] == "1-0"
    assert whole.choices[0].text == generate(rr, PROMPTS[1], max_new_tokens=10, path="1-0").text
    chunks = list(client.completions.create(model="tiny/1-0", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    many = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=4, temperature=0.7, seed=5, n=2)
    assert sorted(c.index for c in many.choices) == list(range(6))
    again = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=4, temperature=0.7, seed=5, n=2)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(again.choices, key=lambda c: c.index)]  # seeded sampling repeats
    ids = rr.encode(PROMPTS[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == generate(rr, PROMPTS[0], max_new_tokens=6).text
    stop = whole.choices[0].text[2:4]
    stopped = client.completions.create(model="tiny/1-0", prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=[stop])
    expected = whole.choices[0].text[:whole.choices[0].text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == expected


def test_echo_logprobs_are_dipacos_own_scores(client, rr):
    """What lm-eval's local-completions asks for log-likelihood: every prompt token's log-probability."""
    for prompt in PROMPTS[4:]:
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                           temperature=0)
        choice = answer.choices[0]
        path = choice.model_dump()["path"]
        ids = rr.encode(prompt)
        ours = -loaded_scorer(rr)([(path, ids)])[0]
        assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
        assert np.allclose(choice.logprobs.token_logprobs[1:], ours, atol=1e-4, rtol=0)
        assert "".join(choice.logprobs.tokens) == prompt and len(choice.logprobs.top_logprobs) == len(ids)


PAIRS = [("def read_config(path):", "\n    with open(path) as f:"), ("The history of the", " city begins"),
         ("import numpy as np", "\nimport torch"), ("Once upon a time", " there was a king"),
         ("SELECT name FROM", " users WHERE id = 1")]


def task_dir(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n" for c, x in PAIRS))
    (tmp_path / "dipaco_pairs.yaml").write_text(f"""task: dipaco_pairs
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
""")
    return tmp_path


def test_lm_eval_local_completions_scores_like_dipaco(server, rr, tmp_path, monkeypatch):
    """lm-evaluation-harness's ``local-completions`` model pointed at the server: a local log-likelihood task (offline)
    gets, request by request, what dipaco's own scorer gives the same tokens on the path the server routed."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the test extra: pip install -e '.[test]'")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.url + "/v1/completions", "model": "tiny", "tokenizer_backend": "huggingface",
                    "tokenizer": str(rr.shards.root / "tokenizer"), "tokenized_requests": True, "max_length": 60,
                    "num_concurrent": 4},
        tasks=["dipaco_pairs"], task_manager=TaskManager(include_path=str(task_dir(tmp_path))), log_samples=True)
    samples = out["samples"]["dipaco_pairs"]
    assert len(samples) == len(PAIRS)
    score = loaded_scorer(rr)
    for sample in samples:
        context, continuation = sample["arguments"][0]
        whole, ctxlen = rr.encode(context + continuation), len(rr.encode(context))
        path = route_ids(rr, whole)[0]  # the path dipaco generate gives the prompt the server saw
        nll = score([(path, whole)])[0]
        harness_ll = sample["resps"][0][0][0]
        assert np.isclose(harness_ll, -nll[ctxlen - 1:].sum(), atol=1e-4 * len(whole), rtol=0), (context, path)
    assert "perplexity,none" in out["results"]["dipaco_pairs"]


def test_sixteen_concurrent_requests_share_forward_passes(client, server, rr):
    jobs = [(f"tiny/{rr.paths[i % 4]}", PROMPTS[i % 8]) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda j: client.completions.create(model=j[0], prompt=j[1], max_tokens=24,
                                                                      temperature=0), jobs))
    assert all(a.choices[0].model_dump()["path"] == j[0].split("/")[1] for a, j in zip(answers, jobs))
    assert server.metric("dipaco_batch_size_max") > 1
    for p in rr.paths:
        assert server.metric(f'dipaco_path_requests_total{{path="{p}"}}') >= 4


def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, server):
    cases = [(b"{not json", 400), ({"model": "nope", "prompt": "x"}, 404), ({"model": "tiny/9-9", "prompt": "x"}, 404),
             ({"model": "tiny", "prompt": "word " * 5000}, 400), ({"model": "tiny", "prompt": "x", "temperature": 9}, 400),
             ({"model": "tiny", "prompt": "x", "n": 0}, 400), ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
             ({"model": "tiny", "prompt": "x", "logprobs": 50}, 400), ({"model": "tiny", "prompt": []}, 400),
             ({"model": "tiny", "prompt": [10**9]}, 400), ({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400),
             ({"model": "tiny", "prompt": "x", "frequency_penalty": 1.0}, 400), ({"prompt": "x"}, 400), ([1, 2], 400)]
    for body, status in cases:
        code, answer, _ = server.post("/v1/completions", body)
        assert code == status, (body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    code, answer, _ = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and "chat template" in answer["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny/7", prompt="x", max_tokens=1)
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).choices[0].text is not None
    assert server.metric('dipaco_requests_total{endpoint="/v1/completions",status="400"}') >= 11
    errors = [line for line in server.stderr if " 400: " in line or " 404: " in line]
    assert len(errors) >= 14 and all(line.count("\n") == 1 for line in errors)


def test_a_disconnected_stream_frees_its_row(client, server):
    stream = client.completions.create(model="tiny/0-0", prompt="a", max_tokens=60, temperature=0.9, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 20
    while (server.metric("dipaco_queue_depth") or server.metric("dipaco_batcher_jobs")) and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("dipaco_queue_depth") == 0 and server.metric("dipaco_batcher_jobs") == 0


KEY = {"authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def guarded(run, rr):
    """A server with a key, a queue of 4 choices and a module budget that any two paths fit, and that budget."""
    modules = rr.run.root / "checkpoints" / f"round_{rr.run.latest()}" / "modules"
    sizes = sorted(sum((modules / f"{m}.safetensors").stat().st_size for m in rr.run.grid.path_modules(p)) for p in rr.paths)
    budget = sizes[-1] + sizes[-2]
    s = ServerProcess("--run", str(run), "--name", "tiny", "--max-memory", str(budget), "--api-key", "sekret",
                      "--max-queue", "4")
    s.headers = KEY
    yield s, budget
    s.stop(signal.SIGKILL)


def test_a_memory_budget_of_two_paths_holds_while_every_path_is_asked(guarded, rr):
    s, budget = guarded
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
    seen = []
    for round_ in range(2):
        for p in rr.paths:
            assert c.completions.create(model=f"tiny/{p}", prompt="x", max_tokens=3).choices[0].model_dump()["path"] == p
            seen.append(s.metric("dipaco_resident_module_bytes"))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: c.completions.create(model=f"tiny/{rr.paths[i % 4]}", prompt="y", max_tokens=5), range(8)))
    seen.append(s.metric("dipaco_resident_module_bytes"))
    assert 0 < max(seen) <= budget
    assert s.metric("dipaco_module_evictions_total") > 0


def test_keys_off_loopback_queue_bound_and_sigterm(guarded, run):
    from dipaco.cli.commands import main

    assert main(["serve", "--run", str(run), "--host", "0.0.0.0", "--port", "0"]) == 2  # no key: refused, nothing bound
    s, _ = guarded
    assert s.post("/v1/completions", {"model": "tiny", "prompt": "x"})[0] == 401
    assert s.post("/v1/completions", {"model": "tiny", "prompt": "x"}, {"authorization": "Bearer guess"})[0] == 401
    assert s.get("/v1/models")[0] == 401 and s.get("/health")[0] == 200
    assert s.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, KEY)[0] == 200
    long = {"model": "tiny/0-1", "prompt": "x", "max_tokens": 40, "temperature": 1.0}
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: s.post("/v1/completions", long, KEY), range(10)))
    codes = sorted(code for code, _, _ in answers)
    assert 200 in codes and 429 in codes
    assert all(h.get("retry-after") == "1" for code, _, h in answers if code == 429)
    # SIGTERM: the request in flight is answered, then the server exits cleanly
    result = {}
    worker = threading.Thread(target=lambda: result.update(answer=s.post("/v1/completions", long, KEY)))
    worker.start()
    time.sleep(0.3)
    assert s.stop(signal.SIGTERM) == 0
    worker.join(30)
    assert result["answer"][0] == 200 and result["answer"][1]["choices"][0]["text"] is not None


def test_the_front_router_forwards_to_upstreams_and_survives_one_dying(run, rr, tmp_path):
    """Two paths served by `dipaco serve --model` upstreams (one of them then SIGKILLed), the others locally."""
    ups = {}
    try:
        for p in ("0-1", "1-0"):
            rr.export(p, tmp_path / p)
        chat_dir = tmp_path / "chat"  # the same path with a chat template: chat completions work
        shutil.copytree(tmp_path / "0-1", chat_dir)
        config = json.loads((chat_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
        (chat_dir / "tokenizer_config.json").write_text(json.dumps(config))
        up01, up10, chat = ServerProcess.start_all(("--model", str(tmp_path / "0-1")), ("--model", str(tmp_path / "1-0")),
                                                   ("--model", str(chat_dir), "--name", "chatty"))
        ups = {"0-1": up01, "1-0": up10, "chat": chat}
        front = ServerProcess("--run", str(run), "--name", "tiny", *[a for p, u in ups.items() if p != "chat"
                                                                      for a in ("--upstream", f"{p}={u.url}")])
        c = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
        for p in ("0-1", "1-0", "0-0"):
            answer = c.completions.create(model=f"tiny/{p}", prompt=PROMPTS[0], max_tokens=8, temperature=0)
            assert answer.choices[0].text == generate(rr, PROMPTS[0], max_new_tokens=8, path=p).text
            assert answer.choices[0].model_dump()["path"] == p
        chunks = list(c.completions.create(model="tiny/0-1", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True))
        assert "".join(x.choices[0].text for x in chunks) == generate(rr, PROMPTS[0], max_new_tokens=8, path="0-1").text
        ups["1-0"].stop(signal.SIGKILL)
        code, answer, _ = front.post("/v1/completions", {"model": "tiny/1-0", "prompt": "x", "max_tokens": 2})
        assert code == 502 and "1-0" in answer["error"]["message"]
        assert c.completions.create(model="tiny/0-1", prompt="x", max_tokens=2).choices[0].model_dump()["path"] == "0-1"
        front.stop()
        cc = openai.OpenAI(base_url=chat.url + "/v1", api_key="unused", max_retries=0)
        reply = cc.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "hello"}], max_tokens=5)
        assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content is not None
        assert "".join(x.choices[0].delta.content or "" for x in cc.chat.completions.create(
            model="chatty", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0, stream=True)) \
            == cc.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                          temperature=0).choices[0].message.content
        chat.stop()
    finally:
        for u in ups.values():
            u.stop(signal.SIGKILL)


def test_prefix_loss_routing_and_route_every_follow_generate(run, tmp_path):
    """A run whose once rule scores the prompt's start with every path (prefix-loss) and whose every-4 rule is
    lagged-loss: the server's paths, segments and greedy text are dipaco generate's."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "routing").mkdir(exist_ok=True)
    (copy / "routing" / "once.json").write_text(json.dumps(
        {"chosen": {"kind": "prefix-loss", "prior": False}, "name": "prefix-loss", "reason": "set by the test"}))
    (copy / "window_routers" / "w4").mkdir(parents=True)
    (copy / "window_routers" / "w4" / "policy.json").write_text(json.dumps(
        {"chosen": {"kind": "lagged-loss", "margin": 0.0, "lookback": 1}, "reason": "set by the test",
         "split": "router_docs", "once_rule": "prefix-loss"}))
    rr = load(copy, progress=False)
    s = ServerProcess("--run", str(copy), "--name", "tiny", "--route-every", "4")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        assert "forward passes" in c.models.list().data[0].model_dump()["routing"]
        for prompt in PROMPTS:
            choice = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].model_dump()
            expected = generate(rr, prompt, max_new_tokens=12, route_every=4)
            assert choice["path"] == route_prompt(rr, prompt)[0] == expected.segments[0][0]
            assert choice["text"] == expected.text
            ours = choice.get("segments") or [{"path": choice["path"], "tokens": expected.new_tokens}]
            merged = [(p, n) for p, n in expected.segments]
            merged = [(p, sum(n for q, n in merged[i:j])) for i, j, p in _runs(merged)]
            assert [(x["path"], x["tokens"]) for x in ours] == merged
        assert s.metric("dipaco_routing_seconds_total") > 0
    finally:
        s.stop()


def _runs(segments):
    """(start, end, path) of each run of consecutive segments on the same path."""
    out, i = [], 0
    while i < len(segments):
        j = i
        while j < len(segments) and segments[j][0] == segments[i][0]:
            j += 1
        out.append((i, j, segments[i][0]))
        i = j
    return out


def test_bad_command_lines_are_one_line_each(run, tmp_path, capsys):
    from conftest import one_error_line

    from dipaco.cli.commands import main

    cases = [(["--run", str(tmp_path / "nothing")], "not a dipaco run directory"),
             (["--run", str(run), "--model", str(tmp_path)], "serve one thing"),
             (["--model", str(tmp_path)], "not a Hugging Face model directory"),
             (["--run", str(run), "--max-memory", "lots"], "not a size"),
             (["--run", str(run), "--max-memory", "10"], "smaller than one path"),
             (["--run", str(run), "--upstream", "0-1=localhost:1"], "PATH=URL"),
             (["--run", str(run), "--routing", "shard", "--route-every", "-2"], "route_every"),
             (["--run", str(run), "--round", "99"], "no round 99")]
    for args, words in cases:
        assert main(["serve", "--port", "0", *args]) == 2, args
        assert words in one_error_line(capsys, "serve"), args
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--run", str(run), "--port", str(taken.getsockname()[1])]) == 2
        assert "cannot listen" in one_error_line(capsys, "serve")
