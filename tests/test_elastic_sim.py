"""bench/elastic.py, the discrete-event model of the task queue against the synchronous job (fast, pure Python)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from elastic import Model, main, phase_modules, simulate_queue, simulate_sync  # noqa: E402

# no I/O, no jitter, no start-up: only the schedule is left
BARE = Model(paths_per_level=4, rounds=3, phase_compute_s=10.0, jitter=0.0, storage_mbit=1e12, net_mbit=1e12, latency_s=0.0,
             startup_s=0.0, replace_s=0.0)


@pytest.mark.parametrize("workers", [1, 3, 4, 16, 20])
def test_without_io_or_failures_both_engines_take_the_analytic_time(workers):
    expected = BARE.rounds * math.ceil(BARE.paths / workers) * BARE.phase_compute_s
    for sim in (simulate_queue, simulate_sync):
        result = sim(BARE, workers, 0.0, seed=0)
        assert result["wall_s"] == pytest.approx(expected, rel=1e-6), sim.__name__
        assert result["preemptions"] == 0 and result["wasted_s"] == 0


def test_utilisation_never_exceeds_one():
    for m in (BARE, Model(rounds=2, paths_per_level=4), replace(BARE, jitter=0.3, shared_global=False)):
        for workers in (2, 5, 16):
            for rate in (0.0, 0.5, 5.0):
                for sim in (simulate_queue, simulate_sync):
                    u = sim(m, workers, rate, seed=1)["utilisation"]
                    assert 0 < u <= 1 + 1e-9, (sim.__name__, workers, rate, u)


def test_same_seed_same_result_and_another_seed_another():
    m = replace(BARE, jitter=0.2)
    for sim in (simulate_queue, simulate_sync):
        assert sim(m, 5, 1.0, seed=3) == sim(m, 5, 1.0, seed=3)
        assert sim(m, 5, 1.0, seed=3) != sim(m, 5, 1.0, seed=4)


def test_the_synchronous_job_wastes_more_with_rarer_checkpoints():
    m = replace(Model(paths_per_level=4, rounds=8, phase_compute_s=60.0), jitter=0.0)
    wasted = {k: sum(simulate_sync(replace(m, checkpoint_every=k), 8, 2.0, seed=s)["wasted_s"] for s in range(8))
              for k in (1, 4)}
    assert wasted[4] > wasted[1] > 0


def test_a_phase_never_starts_before_its_modules_have_its_round():
    m = replace(BARE, jitter=0.3, shared_global=False, rounds=4)
    log: list = []
    simulate_queue(m, 3, 2.0 * 3600 / 100, seed=2, log=log)  # preempted now and then
    done: set = set()
    for event in log:
        if event[1] == "phase_start":
            _, _, p, r, versions = event
            assert all(v >= r for v in versions), event
            assert r == 0 or (p, r - 1) in done, event
        elif event[1] == "phase_done":
            done.add((event[2], event[3]))
    assert done == {(p, r) for p in range(m.paths) for r in range(m.rounds)}
    assert phase_modules(m, 5) == ["L0.E1", "L1.E1"]


def test_preemptions_cost_the_queue_little_and_the_synchronous_job_much():
    m = Model(paths_per_level=8, rounds=4)
    queue, sync = simulate_queue(m, 16, 0.2, seed=0), simulate_sync(m, 16, 0.2, seed=0)
    assert queue["preemptions"] > 0 and sync["preemptions"] > 0
    assert queue["utilisation"] > 2 * sync["utilisation"]


def test_the_command_prints_a_table_and_writes_json_and_a_plot(capsys, tmp_path):
    assert main(["--quick", "--seeds", "1", "--rounds", "2", "--paths-per-level", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| workers |" in out and "task queue" in out and "synchronous" in out
    assert json.loads((tmp_path / "elastic.json").read_text())["rows"]
    assert (tmp_path / "elastic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sticky_trainees_read_their_state_from_the_worker_cache():
    """With one worker per path and no preemption, every phase after a trainee's first reads no state from storage:
    bytes per phase fall by the state's share; a preempted worker's cache is gone, so its trainees read it again."""
    m = replace(BARE, paths_per_level=2, rounds=4, storage_mbit=1000.0, module_bytes=100e6, state_bytes=200e6,
                payload_bytes=12.5e6)
    plain, sticky = simulate_queue(m, 4, 0.0, seed=0), simulate_queue(replace(m, sticky=True), 4, 0.0, seed=0)
    full = m.module_bytes + 2 * m.state_bytes + m.payload_bytes
    assert plain["storage_bytes_per_phase"] == pytest.approx(full)
    cached_phases = m.rounds - 1  # of every trainee's phases, all but the first hit the cache
    expected = full - m.state_bytes * cached_phases / m.rounds
    assert sticky["storage_bytes_per_phase"] == pytest.approx(expected)
    assert sticky["wall_s"] < plain["wall_s"]  # the state's download is off every cached phase
    lossy = simulate_queue(replace(m, sticky=True), 4, 20.0, seed=3)
    assert expected < lossy["storage_bytes_per_phase"] <= full


def test_sticky_states_written_every_k_rounds_and_replayed_after_a_loss():
    """With the state durable only every K rounds, a phase writes it once per K; a preempted worker's trainees
    read the last durable state and replay the rounds since (their compute counted as wasted)."""
    m = replace(BARE, paths_per_level=2, rounds=4, storage_mbit=1000.0, module_bytes=100e6, state_bytes=200e6,
                payload_bytes=12.5e6, sticky=True)
    every = simulate_queue(m, 4, 0.0, seed=0)
    sparse = simulate_queue(replace(m, state_every=4), 4, 0.0, seed=0)
    # per trainee: 4 module reads, 1 state read (round 0), 4 payloads, and the state written 4 times or once
    assert every["storage_bytes_per_phase"] == pytest.approx(m.module_bytes + m.payload_bytes + m.state_bytes * 5 / 4)
    assert sparse["storage_bytes_per_phase"] == pytest.approx(m.module_bytes + m.payload_bytes + m.state_bytes * 2 / 4)
    assert sparse["wall_s"] < every["wall_s"] and sparse["wasted_s"] == every["wasted_s"] == 0
    lossy = simulate_queue(replace(m, state_every=4), 4, 20.0, seed=3)
    assert lossy["preemptions"] > 0 and lossy["wasted_s"] > 0
    assert lossy["storage_bytes_per_phase"] > sparse["storage_bytes_per_phase"]  # misses read states and replay modules
