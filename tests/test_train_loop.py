"""Small pieces of the round loop, without training (fast). The round losses and the inner optimizer's
arithmetic are pinned end to end by tests/test_golden.py (losses and weights of two runs)."""

from __future__ import annotations

import torch


def test_round_written_by_several_workers_moves_latest_only_when_whole(tmp_path):
    import pytest

    from dipaco.errors import DipacoError
    from dipaco.storage import checkpoint

    modules = {"a": {"w": torch.ones(2, 3)}, "b": {"w": torch.zeros(4)}}
    states = {0: {"step": 1}, 1: {"step": 2}}
    checkpoint.save_round(tmp_path, 0, modules, {}, [states[0], states[1]], {"trainee_paths": ["0", "1"]})
    tmp = checkpoint.begin_round(tmp_path, 1)
    checkpoint.write_modules(tmp, {"a": modules["a"]})          # worker 0's part
    checkpoint.write_trainees(tmp, {0: states[0]})
    with pytest.raises(DipacoError, match="must be shared"):   # worker 1's part never arrived
        checkpoint.finish_round(tmp_path, 1, tmp, ["a", "b"], {}, 2, {"trainee_paths": ["0", "1"]})
    assert checkpoint.latest_round(tmp_path) == 0
    checkpoint.write_modules(tmp, {"b": modules["b"]})          # worker 1's part
    checkpoint.write_trainees(tmp, {1: states[1]})
    checkpoint.finish_round(tmp_path, 1, tmp, ["a", "b"], {}, 2, {"trainee_paths": ["0", "1"]})
    assert checkpoint.latest_round(tmp_path) == 1 and not tmp.exists()
    loaded = checkpoint.load_modules(tmp_path, 1)
    assert torch.equal(loaded["a"]["w"], modules["a"]["w"]) and torch.equal(loaded["b"]["w"], modules["b"]["w"])
    assert [s["step"] for s in checkpoint.load_state(tmp_path, 1)[1]] == [1, 2]


def test_round_losses_are_each_trainees_mean_and_logged_losses_become_floats():
    """What a round line reports: every trainee's mean inner loss over the round's H steps (read from the device
    once per round), and the buffered 'inner' records turned from tensors into floats."""
    import math

    from dipaco.training.phase import round_losses

    H = 4
    steps = {0: [torch.tensor(v) for v in (4.0, 3.5, 3.25, 3.0)], 1: [torch.tensor(v) for v in (2.0, 2.0, 1.0, 1.0)],
             2: []}
    logs = [{"kind": "inner", "loss": steps[0][1]}, {"kind": "inner", "loss": steps[1][3]}]
    got = round_losses(steps, logs, H)
    assert math.isclose(got[0], 13.75 / H, rel_tol=1e-12) and math.isclose(got[1], 6.0 / H, rel_tol=1e-12)
    assert got[2] == 0.0  # a trainee with no steps this round (none here in practice) contributes nothing
    assert [type(r["loss"]) for r in logs] == [float, float] and [r["loss"] for r in logs] == [3.5, 1.0]


def test_round_lines_add_up_to_the_run_s_bytes_when_a_reduction_ends_between_rounds(tmp_path):
    """A streamed reduction may end after a round's line was gathered and before the next round starts (while
    validating or checkpointing); it counts in the next line, so the lines add up to what the world sent. They
    used to count from each round's start, and such a reduction was in no line (a two-node run's total once came
    out 147,968 bytes short of the same run on one node)."""
    import json
    import time

    from dipaco.config import TrainConfig, resolve
    from dipaco.training.train import RoundGather

    class World:  # one rank; its counters move when the test says a reduction ended
        rank, size = 0, 1
        sent = 0

        def stats(self):
            return {"bytes_sent": self.sent, "bytes_received": self.sent, "comm_s": 0.0, "wait_s": 0.0}

        def gather(self, obj):
            return [obj]

    world = World()
    log = RoundGather(tmp_path, resolve(TrainConfig), world, 1, 3, progress=False)
    report = {"losses": {0: 1.0}, "inner": [], "compute_s": 0.0, "began": time.perf_counter()}
    for r, (during, between) in enumerate([(100, 0), (10, 7), (0, 0)], start=1):
        world.sent += during   # ends within round r
        log.round(r, report, {})
        world.sent += between  # ends after round r's line, before round r + 1 begins
    log.close()
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["bytes_sent"] for l in lines if l["kind"] == "round"] == [100, 10, 7]
