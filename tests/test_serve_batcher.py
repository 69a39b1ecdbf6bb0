"""The serving core without HTTP: modules held once, the budget, and continuous batching that changes no number.

A random tiny Llama per path (random weights give varied tokens, so a wrong mask or position shows at once) stands in
for a run's modules; the reference for every number is the same model run on one sequence without a cache.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.errors import DipacoError
from dipaco.eval.serve.batcher import Batcher, Job
from dipaco.eval.serve.modules import ModuleCache, assemble

CONFIG = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=96,
                     bos_token_id=96, pad_token_id=96)


class FakeSource:
    """Paths 'a', 'b', 'c', 'd' on a 2x2 grid: level-0 module x0|x1 (the embedding and block 0) and level-1 module
    y0|y1 (block 1 and the final norm); each module's tensors come from its own seeded random model."""

    def __init__(self):
        self.config = CONFIG
        self.paths = ["a", "b", "c", "d"]
        self.path_modules = {"a": ["x0", "y0"], "b": ["x0", "y1"], "c": ["x1", "y0"], "d": ["x1", "y1"]}
        self.loads: list[str] = []
        self.nbytes = {m: sum(t.numel() * 4 for t in self._tensors(m).values()) for m in ("x0", "x1", "y0", "y1")}

    def _tensors(self, module: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(hash(module) % 1000 + 1)
        model = LlamaForCausalLM(CONFIG)
        first = module.startswith("x")
        return {n: p.detach().clone() for n, p in model.named_parameters()
                if (n.startswith(("model.embed_tokens", "model.layers.0.")) if first else
                    n.startswith(("model.layers.1.", "model.norm")))}

    def load(self, module: str) -> dict[str, torch.Tensor]:
        self.loads.append(module)
        return self._tensors(module)


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def run_jobs(batcher: Batcher, jobs: list[Job], events: dict[int, list], stagger: float = 0.0) -> None:
    done = [threading.Event() for _ in jobs]
    for i, job in enumerate(jobs):
        def emit(kind, payload, i=i):
            events[i].append((kind, payload))
            if kind in ("done", "error"):
                done[i].set()
        job.emit = emit
        batcher.submit(job)
        time.sleep(stagger)
    assert all(d.wait(60) for d in done)


def test_paths_share_module_tensors_without_copies():
    source = FakeSource()
    cache = ModuleCache(source, budget=10**9)
    a, b = cache.load("a"), cache.load("b")
    assert a.model.embed_tokens.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()  # x0, held once
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied head
    assert a.model.layers[1].mlp.up_proj.weight.data_ptr() != b.model.layers[1].mlp.up_proj.weight.data_ptr()
    assert sorted(source.loads) == ["x0", "y0", "y1"]  # x0 was loaded once
    assert cache.resident_bytes == sum(source.nbytes[m] for m in ("x0", "y0", "y1"))


def test_budget_evicts_least_recently_used_and_never_a_pinned_path():
    source = FakeSource()
    two_paths = source.nbytes["x0"] + source.nbytes["y0"] + source.nbytes["y1"]
    cache = ModuleCache(source, budget=two_paths)
    cache.load("a"), cache.load("b")
    cache.pin("b")
    assert cache.load("c") is None  # c needs x1: only y0 is free to go (b is pinned), and that is not enough room
    cache.pin("b", -1)
    cache.model("b")  # b used last, so a's y0 is the oldest; c needs it, so x0 (b's, next oldest) makes the room
    assert cache.load("c") is not None
    assert cache.resident_bytes <= two_paths
    assert set(cache.modules) == {"x1", "y0", "y1"} and set(cache.models) == {"c"}
    with pytest.raises(DipacoError, match="smaller than one path"):
        ModuleCache(source, budget=source.nbytes["x0"])


def test_assembled_model_equals_a_model_loaded_by_copy():
    source = FakeSource()
    tensors = {**source.load("x0"), **source.load("y1")}
    copied = LlamaForCausalLM(CONFIG).eval()
    copied.load_state_dict(tensors, strict=False)
    ids = torch.tensor([[5, 17, 3, 88, 42]])
    with torch.inference_mode():
        assert torch.equal(assemble(CONFIG, tensors)(input_ids=ids).logits, copied(input_ids=ids).logits)


def test_rows_joining_and_leaving_a_batch_get_the_numbers_of_a_lone_sequence():
    """Prompts of different lengths on two paths, joining while others decode and leaving at different lengths: every
    new token is the greedy token of the sequence alone, and every reported log-probability matches (1e-4)."""
    source = FakeSource()
    cache = ModuleCache(source, budget=10**9)
    batcher = Batcher(cache, eos=CONFIG.eos_token_id, max_batch=3).start()
    g = torch.Generator().manual_seed(0)
    jobs = [Job(path="ab"[i % 2], ids=torch.randint(0, 95, (3 + 5 * i,), generator=g).tolist(), max_new=4 + 3 * (i % 3),
                emit=None, prompt_logprobs=(i == 2), top_logprobs=2) for i in range(7)]
    events = {i: [] for i in range(len(jobs))}
    run_jobs(batcher, jobs, events, stagger=0.01)
    batcher.stop()
    for i, job in enumerate(jobs):
        tokens = [p for k, p in events[i] if k == "token"]
        assert events[i][-1] == ("done", "length") and len(tokens) == job.max_new
        seq = job.ids + [t for t, _, _ in tokens]
        ref = reference_logprobs(cache.model(job.path), seq)
        for n, (token, lp, top) in enumerate(tokens):
            row = ref[len(job.ids) - 1 + n]
            assert token == int(row.argmax()), (i, n)
            assert abs(lp - float(row[token])) < 1e-4
            assert [t for t, _ in top] == row.topk(2).indices.tolist()
        if job.prompt_logprobs:
            prompt = [p for k, p in events[i] if k == "prompt"][0]
            assert len(prompt) == len(job.ids) - 1
            assert all(abs(lp - float(ref[t, job.ids[t + 1]])) < 1e-4 for t, (lp, _) in enumerate(prompt))


def test_cancelled_rows_leave_and_sampling_is_seeded():
    source = FakeSource()
    batcher = Batcher(ModuleCache(source, budget=10**9), eos=CONFIG.eos_token_id).start()
    ids = [1, 2, 3, 4]
    jobs = [Job("a", ids, 30, None, temperature=1.0, top_p=0.9, seed=7) for _ in range(2)]
    jobs.append(Job("a", ids, 10_000, None))
    events = {i: [] for i in range(3)}

    def cancel_later():
        time.sleep(0.3)
        jobs[2].cancelled = True

    threading.Thread(target=cancel_later).start()
    run_jobs(batcher, jobs, events)
    batcher.stop()
    first, second = ([p[0] for k, p in events[i] if k == "token"] for i in (0, 1))
    assert first == second and len(first) > 5  # the same seed, the same tokens, even side by side in one batch
    assert events[0][-1][1] in ("stop", "length") and (events[0][-1][1] == "stop") == (first[-1] == CONFIG.eos_token_id)
    assert events[2][-1] == ("done", "cancelled")
    assert batcher.in_flight == 0 and not batcher.cache.pins


@pytest.mark.parametrize("paths_in_budget", [1, 2])
def test_a_cold_path_waits_for_memory_while_others_are_answered(paths_in_budget):
    """A budget of one or two paths and requests for all four at once: every request is answered (no path starves,
    none deadlocks waiting for another's memory) and the resident bytes never pass the budget."""
    source = FakeSource()
    one = source.nbytes["x0"] + source.nbytes["y0"]
    budget = one if paths_in_budget == 1 else one + source.nbytes["y1"]
    cache = ModuleCache(source, budget=budget)
    batcher = Batcher(cache, eos=CONFIG.eos_token_id).start()
    seen = []
    sampler = threading.Thread(target=lambda: [seen.append(cache.resident_bytes) or time.sleep(0.005) for _ in range(200)])
    sampler.start()
    jobs = [Job("abcd"[i % 4], [1 + i, 2, 3], 6, None) for i in range(12)]
    events = {i: [] for i in range(len(jobs))}
    run_jobs(batcher, jobs, events)
    batcher.stop()
    sampler.join()
    assert all(e[-1] == ("done", "length") for e in events.values())
    assert max(seen) <= budget and not cache.pins


class SlowSource(FakeSource):
    def load(self, module: str) -> dict[str, torch.Tensor]:
        time.sleep(0.4)
        return super().load(module)


def test_a_request_that_leaves_while_its_path_loads_leaves_no_pin():
    """A client that goes while its cold path loads: the loader's pin of that path is given back, so under a budget of
    one path another path still loads and answers (a kept pin would hold the memory for good)."""
    source = SlowSource()
    cache = ModuleCache(source, budget=source.nbytes["x0"] + source.nbytes["y0"])
    batcher = Batcher(cache, eos=CONFIG.eos_token_id).start()
    gone = Job("a", [1, 2, 3], 4, None)
    events = {0: []}
    gone.emit = lambda kind, payload: events[0].append((kind, payload))
    batcher.submit(gone)
    time.sleep(0.2)  # the loader is bringing a in
    gone.cancelled = True
    time.sleep(1.2)  # a is resident now
    later = {0: []}
    run_jobs(batcher, [Job("d", [1, 2, 3], 4, None)], later)
    batcher.stop()
    assert events[0] == [("done", "cancelled")] and later[0][-1] == ("done", "length")
    assert batcher.in_flight == 0 and not cache.pins


def test_stopping_ends_every_job_and_refuses_new_ones():
    """Jobs still running or waiting when the batcher stops end with an error (a thread waiting for one, as routing
    does with no timeout, waited forever and held the process at exit), and a job submitted afterwards too."""
    batcher = Batcher(ModuleCache(FakeSource(), budget=10**9), eos=CONFIG.eos_token_id).start()
    events = {i: [] for i in range(3)}
    ended = [threading.Event() for _ in range(3)]
    jobs = [Job("a", [1, 2, 3], 100_000, None), Job("b", [4, 5], 100_000, None), Job("a", [6], 100_000, None)]
    for i, job in enumerate(jobs):
        job.emit = lambda kind, payload, i=i: (events[i].append((kind, payload)),
                                               kind in ("done", "error") and ended[i].set())
    batcher.submit(jobs[0]), batcher.submit(jobs[1])
    deadline = time.time() + 30
    while not (events[0] and events[1]) and time.time() < deadline:
        time.sleep(0.01)
    batcher.stop()
    assert ended[0].wait(10) and ended[1].wait(10)
    batcher.threads[0].join(10)
    batcher.submit(jobs[2])
    assert ended[2].wait(1)
    assert all(events[i][-1][0] == "error" for i in range(3)) and batcher.in_flight == 0


def test_a_temperature_that_overflows_the_logits_samples_greedily_and_the_batcher_lives():
    """temperature 1e-50 (a valid request) made the probabilities NaN; multinomial raised on the batcher's thread,
    which ended, and every request after it waited forever."""
    batcher = Batcher(ModuleCache(FakeSource(), budget=10**9), eos=CONFIG.eos_token_id).start()
    jobs = [Job("a", [1, 2, 3], 5, None, temperature=1e-50), Job("a", [1, 2, 3], 5, None)]
    events = {0: [], 1: []}
    run_jobs(batcher, jobs[:1], events)
    run_jobs(batcher, jobs[1:], {0: events[1]})  # the thread lives: this one is answered
    batcher.stop()
    assert [p[0] for k, p in events[0] if k == "token"] == [p[0] for k, p in events[1] if k == "token"]
    assert events[0][-1] == ("done", "length")


class RacingCache(ModuleCache):
    """The loader's eviction landing between the batcher's look at a resident path and its pin of that path."""
    raced = False

    def model(self, path):
        model = super().model(path)
        if model is not None and not self.raced and not self.pins.get(path):
            self.raced = True
            with self.lock:
                self._make_room(self.budget, keep=set())  # every unpinned module leaves, as for another path's load
        return model


def test_rows_never_run_on_a_path_evicted_before_its_pin():
    cache = RacingCache(FakeSource(), budget=10**9)
    cache.raced = True
    cache.load("a")
    cache.raced = False  # armed: the batcher's first look at a is raced
    batcher = Batcher(cache, eos=CONFIG.eos_token_id).start()
    job = Job("a", [1, 2, 3], 4, None)
    events = {0: []}
    run_jobs(batcher, [job], events)
    batcher.stop()
    assert cache.raced and events[0][-1] == ("done", "length")
    # every token came from a model whose modules the budget counts (it was loaded again), not from evicted tensors
    assert cache.source.loads.count("x0") == 2 and "a" in cache.models and not cache.pins


def test_a_failure_outside_the_forward_pass_fails_its_rows_and_the_batcher_lives(monkeypatch):
    from dipaco.eval.serve import batcher as batcher_module

    batcher = Batcher(ModuleCache(FakeSource(), budget=10**9), eos=CONFIG.eos_token_id).start()
    real_add, real_keep = batcher_module.PathBatch.add, batcher_module.PathBatch.keep
    for target, name in ((batcher_module.PathBatch, "add"), (batcher_module.PathBatch, "keep")):
        def broken(*args, **kwargs):
            raise MemoryError("no room")
        monkeypatch.setattr(target, name, broken)
        events = {0: []}
        run_jobs(batcher, [Job("a", [1, 2, 3], 5, None)], events)
        assert events[0][-1][0] == "error" and "no room" in events[0][-1][1]
        monkeypatch.setattr(batcher_module.PathBatch, "add", real_add)
        monkeypatch.setattr(batcher_module.PathBatch, "keep", real_keep)
    events = {0: []}
    run_jobs(batcher, [Job("a", [1, 2, 3], 5, None)], events)  # the same batcher answers the next request
    batcher.stop()
    assert events[0][-1] == ("done", "length") and not batcher.cache.pins
