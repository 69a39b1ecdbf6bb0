"""The Ray engine (`dipaco train --engine ray`) on a real local multi-node Ray cluster (one per test session).

Every test runs the real CLI as a driver process against the cluster, and compares the final checkpoint with the
in-process engine's on the same config and seed, bit for bit: plain, at 4 bits with more paths than workers, and
through a worker SIGKILLed mid-phase, an executor SIGKILLed mid-step, a node removed (and another added) mid-run,
and a driver SIGKILLed and resumed. The quorum test leaves one phase late on purpose and checks it is dropped.
Faults are placed with the tests' own hooks (tests/faults.py), which make the first attempt of a chosen phase or
outer step sleep in its middle.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_TRAIN, shard_config, tiny_train_config
from faults import fault_env

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.slow

ROUNDS, H = 3, 10


@pytest.fixture(scope="session")
def cluster(ray_cluster):
    """The session's two-node local cluster (tests/conftest.py)."""
    return ray_cluster


@pytest.fixture(scope="session")
def shards_4x4(corpus_file, tmp_path_factory) -> Path:
    """16 paths (i.i.d. shards: the small test corpus does not spread over 16 k-means paths)."""
    from dipaco.sharding.writer import shard

    out = tmp_path_factory.mktemp("shards") / "s4x4"
    shard([str(corpus_file)], shard_config("4x4", 'routing.assign="random"'), out, progress=False)
    return out


_reference: dict = {}


def reference(shards: Path, tmp_path_factory, *extra: str) -> Path:
    """The in-process engine's run of the same config (one per config and shard directory, per session)."""
    from dipaco.training.train import train

    key = (str(shards), extra)
    if key not in _reference:
        out = tmp_path_factory.mktemp("reference") / "run"
        train(tiny_train_config(*extra, rounds=ROUNDS, inner_steps=H), shards, out, progress=False)
        _reference[key] = out
    return _reference[key]


def start_driver(shards: Path, out: Path, cluster, *extra: str, resume: bool = False, env: dict | None = None):
    sets = [a for kv in TINY_TRAIN + list(extra) for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(out), "--rounds", str(ROUNDS),
           "--inner-steps", str(H), "--engine", "ray", "--address", cluster.address, "--quiet", *sets]
    return subprocess.Popen(cmd + (["--resume"] if resume else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def finish(proc, timeout: float = 240) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def wait_for(condition, what: str, timeout: float = 120):
    until = time.time() + timeout
    while time.time() < until:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def first_attempt(run: Path, version: int, who: str) -> dict | None:
    """The first started attempt of phase (trainee, version) (``who`` = "trainee_<i>") or outer step ("step_<group>")."""
    for f in sorted(run.glob(f"queue/*/attempts/{version}/{who}/*.json")):
        try:
            return json.loads(f.read_text())
        except ValueError:  # being written (an object is written whole, but a test may read a local file early)
            return None
    return None


def assert_same_weights(a: Path, b: Path) -> None:
    ra, rb = (run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() for run in (a, b))
    assert ra.name == rb.name == f"round_{ROUNDS}"
    files = sorted(p.name for p in (ra / "modules").glob("*.safetensors"))
    assert files == sorted(p.name for p in (rb / "modules").glob("*.safetensors"))
    for name in files + ["../state/outer.safetensors"]:
        ta, tb = load_file(str(ra / "modules" / name)), load_file(str(rb / "modules" / name))
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{name} {k} differs"


def rounds(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "round"]


def test_same_bits_as_the_in_process_engine_2x2(shards_2x2, cluster, tmp_path, tmp_path_factory):
    out = tmp_path / "ray"
    summary = json.loads(finish(start_driver(shards_2x2, out, cluster)).strip().splitlines()[-1])
    assert summary["engine"] == "ray" and summary["workers"] == 2
    ref = reference(shards_2x2, tmp_path_factory)
    assert_same_weights(ref, out)
    mine, theirs = rounds(out), rounds(ref)
    assert [r["round"] for r in mine] == [1, 2, 3]
    for a, b in zip(mine, theirs):  # the same losses: the same computation
        assert a["train_loss_by_trainee"] == b["train_loss_by_trainee"] and a["val_loss"] == b["val_loss"]
        assert {p["trainee"] for p in a["phases"]} == {0, 1, 2, 3} and all(p["attempts"] == 1 for p in a["phases"])
    assert not (out / "queue").exists()  # the finished run's checkpoints hold everything


def test_same_bits_at_4_bits_with_more_paths_than_workers(shards_4x4, cluster, tmp_path, tmp_path_factory):
    out = tmp_path / "ray"
    finish(start_driver(shards_4x4, out, cluster, "comm.bits=4"))
    assert_same_weights(reference(shards_4x4, tmp_path_factory, "comm.bits=4"), out)
    nodes = {p["node"] for r in rounds(out) for p in r["phases"]}
    assert len(nodes) == 2  # 16 paths on two nodes' workers
    assert all(r["bytes_sent"] < r["bytes_loaded"] / 6 for r in rounds(out))  # 4-bit payloads vs fp32 weights


def test_a_worker_killed_mid_phase_is_retried_with_the_same_bits(shards_2x2, cluster, tmp_path, tmp_path_factory):
    out = tmp_path / "ray"
    proc = start_driver(shards_2x2, out, cluster, env=fault_env("1:1:60", tmp_path / "faults"))
    victim = wait_for(lambda: first_attempt(out, 1, "trainee_1"), "phase (1, 1) to start")
    time.sleep(1.0)  # it is asleep halfway through its inner steps now
    os.kill(victim["pid"], signal.SIGKILL)
    finish(proc)
    assert_same_weights(reference(shards_2x2, tmp_path_factory), out)
    retried = rounds(out)[1]
    assert retried["retried"] == [1] and [p["attempts"] for p in retried["phases"]] == [1, 2, 1, 1]


def test_an_executor_killed_mid_step_restarts_with_the_same_bits(shards_2x2, cluster, tmp_path, tmp_path_factory):
    out = tmp_path / "ray"
    proc = start_driver(shards_2x2, out, cluster, env=fault_env("step:1:60", tmp_path / "faults"))
    victim = wait_for(lambda: next(filter(None, (first_attempt(out, 1, d.name) for d in
                                                 out.glob("queue/*/attempts/1/step_*"))), None),
                      "an outer step from version 1 to start")
    time.sleep(1.0)
    os.kill(victim["pid"], signal.SIGKILL)
    finish(proc)
    assert_same_weights(reference(shards_2x2, tmp_path_factory), out)
    assert any(s["pid"] != victim["pid"] for s in rounds(out)[1]["steps"])  # the restarted executor finished the round


def test_a_node_removed_and_another_added_mid_run(shards_2x2, cluster, tmp_path, tmp_path_factory):
    out = tmp_path / "ray"
    spare = cluster.add_node(num_cpus=1)  # three 1-CPU nodes: three of a round's four phases run at once
    cluster.wait_for_nodes()
    # round 2's phases sleep 5 s (one is lost with the spare node); round 3's sleep 3 s, so its four phases overlap
    # and the two nodes their trainees last ran on cannot take them all: a sticky phase spills to the joined node
    delays = [f"{i}:1:5" for i in range(4)] + [f"{i}:2:3" for i in range(4)]
    proc = start_driver(shards_2x2, out, cluster, env=fault_env(",".join(delays), tmp_path / "faults"))
    running = wait_for(lambda: [a for i in range(4) if (a := first_attempt(out, 1, f"trainee_{i}"))
                                and a["node"] == spare.node_id], "a round-2 phase on the spare node")
    cluster.remove_node(spare, allow_graceful=False)  # its phase (asleep mid-way) is lost with it
    joined = cluster.add_node(num_cpus=1)
    try:
        finish(proc)
    finally:
        cluster.remove_node(joined)
    assert_same_weights(reference(shards_2x2, tmp_path_factory), out)
    later = [p for r in rounds(out)[1:] for p in r["phases"]]
    assert any(p["node"] == joined.node_id for p in later), "the node added mid-run took no phase"
    assert rounds(out)[1]["retried"] and running


def test_a_driver_killed_mid_run_resumes_with_the_same_bits(shards_2x2, cluster, tmp_path, tmp_path_factory):
    out = tmp_path / "ray"
    proc = start_driver(shards_2x2, out, cluster, env=fault_env("2:1:60", tmp_path / "faults"))
    # round 1 committed: its directory is renamed into place before `latest` moves, and round 2's phases need only
    # round 1's modules, so waiting for the directory alone could kill the driver between the two
    latest = out / "checkpoints" / "latest"
    wait_for(lambda: latest.is_file() and latest.read_text().strip() == "round_1" and first_attempt(out, 1, "trainee_2"),
             "round 1 committed and round 2 started")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (out / "checkpoints" / "round_1").is_dir() and latest.read_text().strip() == "round_1"
    finish(start_driver(shards_2x2, out, cluster, resume=True))  # the delay hook only slows a first attempt
    assert_same_weights(reference(shards_2x2, tmp_path_factory), out)
    assert [r["round"] for r in rounds(out)] == [1, 2, 3]  # no round logged twice


def test_states_kept_only_in_lost_caches_are_replayed_with_the_same_bits(shards_2x2, cluster, tmp_path, tmp_path_factory):
    """checkpoint_every=3 with sticky trainees: the states after rounds 1 and 2 live only in the node caches. Every
    cache is lost (its nodes replaced) while the outer step to version 2 is under way; round 3's phases then rebuild
    their trainees' states by replaying rounds 1 and 2 from the round-0 checkpoint, to the in-process run's bits."""
    out, cache = tmp_path / "ray", tmp_path / "cache"
    proc = start_driver(shards_2x2, out, cluster, "checkpoint_every=3",
                        env={"DIPACO_CACHE": str(cache), **fault_env("step:1:20", tmp_path / "faults")})
    commits = lambda: list(out.glob("queue/*/phases/1/trainee_*/commit.json"))  # noqa: E731
    wait_for(lambda: len(commits()) == 4 and list(out.glob("queue/*/attempts/1/step_*/*.json")), "round 2's phases")
    assert not any("state.pt" in json.loads(f.read_text())["objects"] for f in commits())  # in the caches only
    shutil.rmtree(cache / "states")
    finish(proc)
    assert sorted(p.name for p in (out / "checkpoints").glob("round_*")) == ["round_0", "round_3"]
    assert_same_weights(reference(shards_2x2, tmp_path_factory), out)
    replayed = {p["trainee"]: p["replayed"] for p in rounds(out)[-1]["phases"]}
    assert 2 in replayed.values() and set(replayed.values()) <= {0, 2}


def test_a_quorum_goes_ahead_without_a_late_phase(shards_2x2, cluster, tmp_path):
    out = tmp_path / "ray"
    began = time.time()
    finish(start_driver(shards_2x2, out, cluster, "ray.quorum=3", "ray.grace=20.0",
                        env=fault_env("3:1:600", tmp_path / "faults")))
    assert time.time() - began < 300  # it did not wait for the slow phase
    late = rounds(out)[1]
    assert late["dropped"] == [3] and late["train_loss_by_trainee"][3] is None
    # another round may drop trainee 3 too if its next phase waited too long for a worker on a loaded machine
    assert all(r["dropped"] in ([], [3]) for r in rounds(out)), [r["dropped"] for r in rounds(out)]
    steps = {s["group"]: s["contributors"] for s in late["steps"]}
    assert steps["embed+head"] == [0, 1, 2] and steps["L0.E1"] == [2] and steps["L1.E1"] == [1]
    assert (out / "checkpoints" / f"round_{ROUNDS}").is_dir()


def test_the_engines_resume_each_others_runs(shards_2x2, cluster, tmp_path, tmp_path_factory):
    """A run the in-process engine checkpointed at round 1 goes on under Ray, and ends with the same bits."""
    import shutil

    from dipaco.storage.run import Run

    ref = reference(shards_2x2, tmp_path_factory)
    out = tmp_path / "ray"
    shutil.copytree(ref, out)
    for r in range(2, ROUNDS + 1):
        shutil.rmtree(out / "checkpoints" / f"round_{r}")
    (out / "checkpoints" / "latest").write_text("round_1\n")
    finish(start_driver(shards_2x2, out, cluster, resume=True))
    assert_same_weights(ref, out)
    assert Run(out).path_model("1-0").model is not None  # eval, generate and export read it like any run
