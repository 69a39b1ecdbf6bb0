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

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_TRAIN, tiny_train_config
from faults import fault_env

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.slow

ROUNDS, H = 2, 6


_references: dict[int, Path] = {}


def reference_run(shards: Path, tmp_path_factory, rounds: int = ROUNDS) -> Path:
    """The in-process engine's run of the same config, once per number of rounds and session (tests/test_ray_keep_going.py
    compares with the same runs)."""
    from dipaco.training.train import train

    if rounds not in _references:
        out = tmp_path_factory.mktemp("reference") / "run"
        train(tiny_train_config(rounds=rounds, inner_steps=H), shards, out, progress=False)
        _references[rounds] = out
    return _references[rounds]


@pytest.fixture
def reference(shards_2x2, tmp_path_factory) -> Path:
    return reference_run(shards_2x2, tmp_path_factory)


def command(shards, out, *extra: str, address: str = "", rounds: int = ROUNDS, resume: bool = False) -> list[str]:
    sets = [a for kv in TINY_TRAIN for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(out), "--rounds",
           str(rounds), "--inner-steps", str(H), "--engine", "ray", "--quiet", *sets, *extra]
    return cmd + (["--address", address] if address else []) + (["--resume"] if resume else [])


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


_RAY_CORE_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [EWI] \d+ \d+\] \w+\.cc:\d+:")


def lines_of(err: str) -> list[str]:
    """stderr's lines but for the one warning of a cluster without token authentication (the test cluster has none)
    and Ray's own C++ log lines (the driver's Ray core logs a failed RPC to the cluster at ERROR on a loaded machine;
    what dipaco prints is still one line)."""
    return [x for x in err.splitlines()
            if x.strip() and "without token authentication" not in x and not _RAY_CORE_LOG.match(x)]


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
    from dipaco.taskqueue.runstore import pull_run

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
        assert sa["step"] == sb["step"] == rounds * H, name
        assert_equal_tree(sa["sampler"], sb["sampler"], f"{name} sampler")
        assert_equal_tree(sa["optimizer"], sb["optimizer"], f"{name} optimizer")


def assert_equal_tree(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif type(a).__module__ == "numpy":
        assert type(a) is type(b) and (a == b).all(), where
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
    from dipaco.storage.objects import Storage

    url = f"{bucket}/run"
    proc = start(command(shards_2x2, url, address=ray_cluster.address), env=fault_env("1:1:60", tmp_path / "faults"))
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
    from dipaco.storage.objects import Storage
    from dipaco.storage.run import build_grid
    from dipaco.storage.shards import ShardSet
    from dipaco.taskqueue.phases import PhaseSpec, run_phase
    from dipaco.taskqueue.runstore import config_digest
    from dipaco.taskqueue.taskstore import TaskStore, ref
    from dipaco.training.plan import Plan

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

    from dipaco.training.launch import free_port

    port, out = free_port(), tmp_path / "run"

    def new_cluster():
        c = Cluster(initialize_head=True, connect=False,
                    head_node_args={"num_cpus": 1, "include_dashboard": False, "gcs_server_port": port})
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        return c

    c = new_cluster()
    assert c.address.endswith(f":{port}")
    proc = start(command(shards_2x2, out, "--keep-going", address=c.address),
                 env=fault_env("0:1:30,1:1:30,2:1:30,3:1:30", tmp_path / "faults"))
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
    broken.write_bytes(broken.read_bytes()[:1001])  # half a token at its end: no reader can map it
    proc = start(command(shards, out, address=ray_cluster.address, resume=True))
    _, err = proc.communicate(timeout=300)
    lines = lines_of(err)
    assert proc.returncode == 2 and len(lines) == 1 and "ValueError" in lines[0] and "phase" in lines[0], err[-2000:]
    from dipaco.storage.objects import Storage

    tries = [len(attempts(Storage(str(out)), 1, f"trainee_{i}")) for i in range(4)]
    assert max(tries) == 1, tries  # not retried


def test_a_worker_killed_five_times_in_one_phase_does_not_abort(shards_2x2, ray_cluster, reference, tmp_path):
    from dipaco.storage.objects import Storage

    out = tmp_path / "run"
    proc = start(command(shards_2x2, out, address=ray_cluster.address), env=fault_env("2:1:60:5", tmp_path / "faults"))
    for k in range(1, 6):
        a = wait_for(lambda: len(x := attempts(Storage(str(out)), 1, "trainee_2")) >= k and x[k - 1],
                     f"attempt {k} of phase (2, 1)")
        time.sleep(1.0)
        os.kill(a["pid"], signal.SIGKILL)
        if k == 1:  # meanwhile a second driver on the same run is refused in one line naming the first
            second = subprocess.run(command(shards_2x2, out, address=ray_cluster.address, resume=True),
                                    capture_output=True, text=True, env=os.environ.copy())
            lines = lines_of(second.stderr)
            assert second.returncode == 2 and len(lines) == 1 and f"pid {proc.pid}" in lines[0], second.stderr[-2000:]
    finish(proc)
    assert_same_state(reference, out)
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [p["attempts"] for r in rounds if r["kind"] == "round" and r["round"] == 2 for p in r["phases"]][2] == 6


_PORTS = """
import json, socket, sys
from dipaco.taskqueue.ray_cluster import connect
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
hosts = json.loads(sys.argv[1])
print(json.dumps({"gcs": info["address"], "outside": {f"{h}:{p}": reach(h, p) for h in hosts for p in ports},
                  "loopback": {str(p): reach("127.0.0.1", p) for p in ports}}))
ray.shutdown()
"""


def non_loopback_addresses() -> list[str]:
    """This machine's IPv4 addresses other than 127.x: its host name's, and the one a route to the outside leaves
    from (a UDP connect picks the route and sends nothing)."""
    found = set()
    with contextlib.suppress(OSError):
        found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never answered, only routed
        found.add(probe.getsockname()[0])
    return sorted(a for a in found if not a.startswith("127."))


def test_the_local_ray_is_not_reachable_on_other_addresses():
    hosts = non_loopback_addresses()
    done = subprocess.run([sys.executable, "-c", _PORTS, json.dumps(hosts)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["gcs"].startswith("127.0.0.1:") and all(seen["loopback"].values()), seen
    if not hosts:
        pytest.skip("this machine has no non-loopback address to try")
    assert not any(seen["outside"].values()), seen


def round_1_of(reference: Path, out: Path) -> None:
    """A copy of the in-process run as it was after round 1 (round 2 not yet written)."""
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "round_2")
    (out / "checkpoints" / "latest").write_text("round_1\n")


def test_left_over_and_damaged_queues_never_give_other_weights(shards_2x2, ray_cluster, reference, tmp_path):
    """Item 5's worst case: a queue holding version-2 modules of another history (here: zeros, with valid checksums)
    beside a round 1 that the in-process engine wrote; then a queue of this history whose records are damaged (a
    commit record that does not parse, an object that fails its checksum, garbage attempt and validation files).
    Either way the Ray engine resumes to the in-process run's bits: the stale queue is not read, damage is redone."""
    from safetensors.torch import save

    from dipaco.storage.objects import Storage, sha256
    from dipaco.taskqueue.runstore import config_digest
    from dipaco.taskqueue.taskstore import TaskStore

    out = tmp_path / "run"
    round_1_of(reference, out)
    s, digest = Storage(str(out)), config_digest(tiny_train_config(rounds=ROUNDS, inner_steps=H), ROUNDS * H)
    s.write("queue/lineage.json", json.dumps({"token": "stale", "base": 0, "digest": digest}).encode())
    stale = TaskStore(str(out), "stale")
    for f in (reference / "checkpoints" / "round_2" / "modules").glob("*.safetensors"):
        zeros = save({k: torch.zeros_like(t) for k, t in load_file(str(f)).items()})
        base = stale.version_key(2, f.stem)  # group names: a module alone, or joined; a module name suffices here
        stale.commit(base, "a", {f.name: stale.put(base, "a", f.name, zeros)}, {"group": f.stem})
    proc = start(command(shards_2x2, out, address=ray_cluster.address, resume=True))
    _, err = finish(proc)
    assert_same_state(reference, out)
    assert "did not grow from round 1" in err

    out = tmp_path / "damaged"
    round_1_of(reference, out)
    s = Storage(str(out))
    s.write("queue/lineage.json", json.dumps({"token": "here", "base": 1, "digest": digest}).encode())
    q = TaskStore(str(out), "here")
    s.write(f"{q.phase_key(1, 0)}/commit.json", b"{not json")
    base = q.phase_key(1, 1)
    q.commit(base, "a", {"deltas.safetensors": {"sha256": sha256(b"x"), "size": 1},
                         "state.pt": q.put(base, "a", "state.pt", b"truncated")}, {"val_loss": None})
    s.write(f"{q.attempts_key(1, 2)}/garbage.json", b"\x00\x01 not json")
    s.write(q.val_key(2, "0-0"), b"garbage")
    _, err = finish(start(command(shards_2x2, out, address=ray_cluster.address, resume=True)))
    assert_same_state(reference, out)
    assert err.count("done again") >= 2 and "Traceback" not in err, err[-2000:]


def test_sigterm_ends_the_driver_in_one_dipaco_line(shards_2x2, ray_cluster, reference, tmp_path):
    out = tmp_path / "run"
    round_1_of(reference, out)
    proc = start(command(shards_2x2, out, address=ray_cluster.address, resume=True), env=fault_env("0:1:30", tmp_path / "faults"))
    wait_for(lambda: list(out.glob("queue/*/attempts/1/trainee_0/*.json")), "round 2 to start")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = lines_of(err)
    assert proc.returncode == 130 and len(lines) == 1 and lines[0].startswith("dipaco train:"), err[-2000:]
    assert (out / "checkpoints" / "round_1").is_dir() and not (out / "lease.json").exists()


def test_the_command_line_engines_agree_bit_for_bit(shards_2x2, tmp_path):
    """As a new user runs them, without OMP_NUM_THREADS: `dipaco train` (every core available) and `dipaco train
    --engine ray --workers 2` (a local Ray of its own, on 127.0.0.1): both pin the default one thread per trainee."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    runs = {"sync": tmp_path / "sync", "ray": tmp_path / "ray"}
    for engine, out in runs.items():
        cmd = command(shards_2x2, out) if engine == "ray" else [a for a in command(shards_2x2, out) if a != "ray"]
        if engine == "ray":
            cmd += ["--workers", "2"]
        else:
            cmd.remove("--engine")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert_same_state(runs["sync"], runs["ray"])
