"""The task queue on a bucket, without a babysitter, behind a closed door (slow tier).

A real S3-compatible server process (moto's server mode, the session's `s3_server`, checked to refuse a second
`If-None-Match: *` write) and the session's local multi-node Ray cluster (`ray_cluster`). Every run is the real CLI in its
own process, compared bit for bit (modules, outer momentum, every trainee's AdamW moments, step and data cursor)
with the in-process engine's local run of the same config: a 2x2 run into s3:// with a worker SIGKILLed mid-phase,
two attempts of one phase that both finish (the second commit refused, its objects never read), eval on the bucket
run, the whole cluster killed and restarted under --keep-going, a phase that raises, a worker killed five times in
one phase, and the local Ray kept off every non-loopback address.
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

from conftest import TINY_TRAIN, tiny_train_config

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.slow

ROUNDS, H = 2, 6


@pytest.fixture(scope="module")
def reference(shards_2x2, tmp_path_factory) -> Path:
    from dipaco.train import train

    out = tmp_path_factory.mktemp("reference") / "run"
    train(tiny_train_config(rounds=ROUNDS, inner_steps=H), shards_2x2, out, progress=False)
    return out


def command(shards, out, *extra: str, address: str = "", rounds: int = ROUNDS, resume: bool = False) -> list[str]:
    sets = [a for kv in TINY_TRAIN for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(out), "--rounds",
           str(rounds), "--inner-steps", str(H), "--engine", "ray", "--quiet", *sets, *extra]
    return cmd + (["--address", address] if address else []) + (["--resume"] if resume else [])


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc, timeout: float = 300) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out, err


def wait_for(condition, what: str, timeout: float = 120):
    until = time.time() + timeout
    while time.time() < until:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def local_copy(location: str) -> Path:
    from dipaco.runstore import pull_run

    return pull_run(location)


def assert_same_state(a: Path, b: Path, rounds: int = ROUNDS) -> None:
    """Modules, outer momentum and every trainee's state (AdamW moments, step, data cursor) of the last round."""
    ra, rb = (run / "checkpoints" / f"round_{rounds}" for run in (a, b))
    for run in (a, b):
        assert (run / "checkpoints" / "latest").read_text().strip() == f"round_{rounds}"
    names = sorted(p.name for p in (ra / "modules").glob("*.safetensors"))
    assert names and names == sorted(p.name for p in (rb / "modules").glob("*.safetensors"))
    for name in [f"modules/{n}" for n in names] + ["state/outer.safetensors"]:
        ta, tb = load_file(str(ra / name)), load_file(str(rb / name))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    trainees = sorted(p.name for p in (ra / "state").glob("trainee_*.pt"))
    assert len(trainees) == 4 and trainees == sorted(p.name for p in (rb / "state").glob("trainee_*.pt"))
    for name in trainees:
        sa, sb = (torch.load(r / "state" / name, weights_only=True) for r in (ra, rb))
        assert sa["step"] == sb["step"] == rounds * H and sa["sampler"] == sb["sampler"], name
        assert_equal_tree(sa["optimizer"], sb["optimizer"], name)


def assert_equal_tree(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            assert_equal_tree(x, y, where)
    else:
        assert a == b, where


def attempts(storage, version: int, who: str) -> list[dict]:
    found = []
    for lineage in storage.list("queue"):
        base = f"queue/{lineage}/attempts/{version}/{who}"
        for name in storage.list(base):
            try:
                found.append(json.loads(storage.read(f"{base}/{name}")))
            except (ValueError, FileNotFoundError):
                pass
    return sorted(found, key=lambda a: a["started"])


@pytest.fixture
def bucket(s3_server, monkeypatch):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return f"s3://{s3_server.make_bucket()}"


def test_a_bucket_run_with_a_worker_killed_is_the_in_process_run_bit_for_bit(shards_2x2, ray_cluster, reference, bucket,
                                                                              tmp_path):
    from dipaco.storage import Storage

    url = f"{bucket}/run"
    proc = start(command(shards_2x2, url, address=ray_cluster.address), env={"DIPACO_TEST_DELAY": "1:1:60"})
    victim = wait_for(lambda: (a := attempts(Storage(url), 1, "trainee_1")) and a[0], "phase (1, 1) to start")
    time.sleep(1.0)  # asleep halfway through its inner steps now
    os.kill(victim["pid"], signal.SIGKILL)
    finish(proc)
    run = local_copy(url)
    assert_same_state(reference, run)
    assert not Storage(url).list("queue") and not (Path(str(run)) / "queue").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2] and rounds[1]["retried"] == [1]
    assert all(r["storage_read"] > 0 and r["storage_written"] > 0 for r in rounds)

    reports = []  # eval on the bucket run gives the local run's report
    for where in (str(reference), url):
        out = tmp_path / f"report{len(reports)}.json"
        done = subprocess.run([sys.executable, "-m", "dipaco.cli", "eval", "--run", f"r={where}", "--shards",
                               str(shards_2x2), "--out", str(out), "--quiet"], capture_output=True, text=True,
                              env=os.environ.copy())
        assert done.returncode == 0, done.stderr[-2000:]
        reports.append(done.stdout.splitlines()[:-1])  # the table (the last line names the files written)
    assert reports[0] == reports[1] and reports[0]


def test_two_attempts_of_a_phase_finish_and_only_the_first_commit_is_read(shards_2x2, ray_cluster, reference, bucket):
    """Round 1 (the in-process run's) in the bucket; phase (trainee 1, round 2) run twice by hand, as a worker presumed
    lost and its retry would: the second commit is refused, the loser's objects are then damaged on purpose, and the
    Ray engine resumes the run through that queue to the in-process run's bits."""
    from dipaco.phases import PhaseSpec, run_phase
    from dipaco.ray_engine import config_digest
    from dipaco.run import Plan, build_grid
    from dipaco.shards import ShardSet
    from dipaco.storage import Storage
    from dipaco.taskstore import TaskStore, ref

    url, s = f"{bucket}/run", Storage(f"{bucket}/run")
    for f in sorted(reference.rglob("*")):
        rel = str(f.relative_to(reference))
        if f.is_file() and not rel.startswith(("checkpoints/round_2", "checkpoints/latest", "workers")):
            s.write(rel, f.read_bytes())
    s.write("checkpoints/latest", b"round_1\n")
    cfg = tiny_train_config(rounds=ROUNDS, inner_steps=H)
    shards = ShardSet(shards_2x2)
    grid = build_grid(cfg, shards.grid)
    plan = Plan.make(cfg, grid, shards, 1)
    s.write("queue/lineage.json", json.dumps({"token": "race", "base": 1,
                                              "digest": config_digest(cfg, ROUNDS * H)}).encode())
    path, sources = plan.trainees[1]
    spec = PhaseSpec(url, "race", str(shards_2x2), cfg, grid, 1, path, sources, 1, ROUNDS * H,
                     {m: ref(f"checkpoints/round_1/modules/{m}.safetensors") for m in grid.path_modules(path)},
                     ref("checkpoints/round_1/state/trainee_1.pt"), True, False, sources)
    first, second = run_phase(spec), run_phase(spec)
    assert first["committed"] and not second["committed"]
    store = TaskStore(url, "race")
    body = store.read_commit(store.phase_key(1, 1))
    assert body["record"]["attempt"] == first["attempt"]
    losers = [a for a in s.list(store.phase_key(1, 1)) if a not in ("commit.json", body["attempt"])]
    assert len(losers) == 1
    for name in s.list(f"{store.phase_key(1, 1)}/{losers[0]}"):  # were they ever read, the run would fail or differ
        s.write(f"{store.phase_key(1, 1)}/{losers[0]}/{name}", b"not what was committed")
    finish(start(command(shards_2x2, url, address=ray_cluster.address, resume=True)))
    run = local_copy(url)
    assert_same_state(reference, run)
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds if r["kind"] == "round"] == [1, 2]


def test_the_whole_cluster_killed_and_restarted_under_keep_going(shards_2x2, reference, tmp_path):
    from ray.cluster_utils import Cluster

    from dipaco.launch import free_port

    port, out = free_port(), tmp_path / "run"

    def new_cluster():
        c = Cluster(initialize_head=True, connect=False,
                    head_node_args={"num_cpus": 1, "include_dashboard": False, "port": port})
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        return c

    c = new_cluster()
    proc = start(command(shards_2x2, out, "--keep-going", address=f"127.0.0.1:{port}"),
                 env={"DIPACO_TEST_DELAY": "0:1:30,1:1:30,2:1:30,3:1:30"})
    try:
        wait_for(lambda: (out / "checkpoints" / "round_1").is_dir() and list(out.glob("queue/*/attempts/1/trainee_*")),
                 "round 2 to start", timeout=180)
        c.shutdown()  # every node, the head with them; the driver goes with its cluster
        time.sleep(8)
        c = new_cluster()
        _, err = finish(proc, timeout=300)
    finally:
        proc.kill()
        c.shutdown()
    assert_same_state(reference, out)
    assert err.count("waiting for the Ray cluster") == 1, err[-2000:]


def test_a_phase_that_raises_fails_the_run_in_one_line_without_retries(shards_2x2, ray_cluster, reference, tmp_path):
    shards, out = tmp_path / "shards", tmp_path / "run"
    shutil.copytree(shards_2x2, shards)
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "round_2")
    (out / "checkpoints" / "latest").write_text("round_1\n")
    broken = sorted(shards.glob("paths/*/train.bin"))[1]
    broken.unlink()
    broken.mkdir()  # unreadable for anyone, root included
    proc = start(command(shards, out, address=ray_cluster.address, resume=True))
    _, err = proc.communicate(timeout=300)
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "IsADirectoryError" in lines[0], err[-2000:]
    from dipaco.storage import Storage

    tries = [len(attempts(Storage(str(out)), 1, f"trainee_{i}")) for i in range(4)]
    assert max(tries) == 1, tries  # not retried


def test_a_worker_killed_five_times_in_one_phase_does_not_abort(shards_2x2, ray_cluster, reference, tmp_path):
    from dipaco.storage import Storage

    out = tmp_path / "run"
    proc = start(command(shards_2x2, out, address=ray_cluster.address), env={"DIPACO_TEST_DELAY": "2:1:60:5"})
    for k in range(1, 6):
        a = wait_for(lambda: len(x := attempts(Storage(str(out)), 1, "trainee_2")) >= k and x[k - 1],
                     f"attempt {k} of phase (2, 1)")
        time.sleep(1.0)
        os.kill(a["pid"], signal.SIGKILL)
    finish(proc)
    assert_same_state(reference, out)
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [p["attempts"] for r in rounds if r["kind"] == "round" and r["round"] == 2 for p in r["phases"]][2] == 6


_PORTS = """
import json, socket, sys
from dipaco.ray_cluster import connect, non_loopback_addresses
import ray
info = connect("", 1)
node = ray.nodes()[0]
ports = {int(info["address"].rsplit(":", 1)[1]), node["NodeManagerPort"], node["ObjectManagerPort"]}
def reach(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False
print(json.dumps({"gcs": info["address"], "hosts": non_loopback_addresses(),
                  "outside": {f"{h}:{p}": reach(h, p) for h in non_loopback_addresses() for p in ports},
                  "loopback": {str(p): reach("127.0.0.1", p) for p in ports}}))
ray.shutdown()
"""


def test_the_local_ray_is_not_reachable_on_other_addresses():
    done = subprocess.run([sys.executable, "-c", _PORTS], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["gcs"].startswith("127.0.0.1:") and all(seen["loopback"].values()), seen
    if not seen["hosts"]:
        pytest.skip("this machine has no non-loopback address to try")
    assert not any(seen["outside"].values()), seen
