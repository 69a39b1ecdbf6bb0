"""A driver that waits out its cluster, never spins and leaves nothing behind (slow tier; issue #38).

Real parts: the session's local two-node Ray cluster, a head started by `ray start --head --block` that the test
stops and restarts, the moto S3 server (tests/s3server.py), the real CLI in its own process. Runs are 2x2, 2 rounds
of 6 inner steps (a fault in the last round, resumed to the end), compared bit for bit with the in-process engine's
run of the same config (the one tests/test_ray_storage.py compares with).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dipaco.storage.objects import Storage
from faults import fault_env
from test_ray_storage import ROUNDS, assert_same_state, attempts, bucket, command, local_copy, start, wait_for  # noqa: F401 (bucket: a fixture)
from test_ray_storage import reference_run as reference

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.slow


def finish(proc, timeout: float = 300) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return out, err


def test_a_resume_whose_round_lacks_a_committed_phases_validation_finishes(shards_2x2, ray_cluster, tmp_path,
                                                                           tmp_path_factory):
    """The stuck state of issue #38: a driver SIGKILLed while the outer steps to round 4 run, with round 2 the last
    checkpoint, round 3 logged and every phase of round 4 committed; one of round 3's validations then gone from
    storage. The resumed driver found nothing in flight and nothing to launch, and looped without end without
    sleeping; now it validates that path again and finishes."""
    out, sets = tmp_path / "run", ("--set", "checkpoint_every=2", "--set", "ray.sticky=false")
    proc = start(command(shards_2x2, out, *sets, address=ray_cluster.address, rounds=4),
                 env=fault_env("step:3:60", tmp_path / "faults"))
    wait_for(lambda: len(list(out.glob("queue/*/phases/3/trainee_*/commit.json"))) == 4
             and list(out.glob("queue/*/attempts/3/step_*/*.json")), "round 4's phases and an outer step", timeout=240)
    proc.kill()
    proc.communicate()
    vals = sorted(out.glob("queue/*/val/3/*.json"))
    assert len(vals) == 4 and (out / "checkpoints" / "latest").read_text().strip() == "round_2"
    vals[2].unlink()
    before = len((out / "metrics.jsonl").read_text().splitlines())
    printed, _ = finish(start(command(shards_2x2, out, *sets, address=ray_cluster.address, rounds=4, resume=True)),
                        timeout=180)
    assert_same_state(reference(shards_2x2, tmp_path_factory, rounds=4), out, rounds=4)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["kind"] == "round"] == [1, 2, 3, 4]
    mine = [r for r in rows[before:] if r["kind"] == "round"]
    summary = json.loads(printed.strip().splitlines()[-1])  # the summary line: the sum of this command's rounds
    assert [r["round"] for r in mine] == [4]
    for key in ("storage_read", "storage_written"):
        assert summary[key] == mine[0][key] > 0, key


# ------------------------------------------------------------------------------------------------ nothing left behind
def holders(name: str) -> list[int]:
    """Processes whose command line or open files name ``name`` (a Ray session: its agents rename themselves)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() or any(
                    name in os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                found.append(int(pid))
        except OSError:
            continue
    return found


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] != "Z":  # a zombie has ended (its parent has not reaped it yet)
                out.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts processes through /proc")
def test_a_killed_driver_and_a_killed_shard_command_leave_no_process(shards_2x2, corpus_file, tmp_path):
    from test_ray_engine import first_attempt
    from test_shard_engines import cli, wait_for as wait_for_file

    out = tmp_path / "run"  # a driver with a local Ray of its own, SIGKILLed mid-phase
    proc = start(command(shards_2x2, out, "--workers", "2", rounds=ROUNDS), env=fault_env("0:1:60", tmp_path / "faults"))
    wait_for(lambda: first_attempt(out, 1, "trainee_0"), "phase (0, 1) to start", timeout=180)
    session = Path(wait_for(lambda: glob.glob(f"/tmp/ray/session_*_{proc.pid}"), "its Ray session")[0]).name
    assert len(holders(session)) >= 5  # GCS, raylet, agents, workers: what must end with it
    proc.kill()
    proc.communicate()
    wait_for(lambda: not alive(holders(session)), f"every process of {session} to end", timeout=20)

    shard_out = tmp_path / "shards"  # a shard command with two pool workers, SIGKILLed mid-block
    proc = cli(corpus_file, shard_out, "--num-proc", "2", env=fault_env("block:0:120", tmp_path / "faults"))
    wait_for_file(tmp_path / "faults" / "block-0.pid", proc)
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
    assert len(children) >= 2  # the pool's workers (and its resource tracker)
    proc.kill()
    proc.communicate()
    wait_for(lambda: not alive(children), "the shard workers to end", timeout=20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts processes through /proc")
def test_a_local_ray_left_in_order_ends_and_its_driver_lives_on():
    """The watcher of a local Ray kills that Ray's stragglers when its driver leaves Ray, and never the driver (which
    holds the session's log files open too)."""
    script = ("import ray, sys\nfrom dipaco.taskqueue.ray_cluster import connect, disconnect\nconnect('', 1, {})\n"
              "print(ray._private.worker._global_node.session_name, flush=True)\ndisconnect()\nprint('after')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.split()[1:] == ["after"], (done.returncode, done.stderr[-2000:])
    session = done.stdout.split()[0]
    wait_for(lambda: not alive(holders(session)), f"every process of {session} to end", timeout=20)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_a_bucket_runs_mirror_is_never_named_and_never_left(shards_2x2, ray_cluster, bucket, tmp_path, tmp_path_factory):
    """The driver's local mirror of an s3:// run: a refused --resume names the URL and leaves no folder; a SIGKILLed
    driver's mirror (no exit code ran) is removed by the next driver, which resumes to the in-process run's bits."""
    url, tmp = f"{bucket}/run", tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), **fault_env("1:1:60", tmp_path / "faults")}
    proc = start(command(shards_2x2, url, address=ray_cluster.address, rounds=ROUNDS), env=env)
    wait_for(lambda: attempts(Storage(url), 1, "trainee_1"), "phase (1, 1) to start", timeout=180)
    assert [p.name.split("-")[2] for p in tmp.glob("dipaco-run-*")] == [str(proc.pid)]
    proc.kill()
    proc.communicate()
    assert len(list(tmp.glob("dipaco-run-*"))) == 1  # SIGKILL: nothing of the driver ran

    refused = subprocess.run(command(shards_2x2, url, "--grid", "1", address=ray_cluster.address, rounds=ROUNDS,
                                     resume=True), capture_output=True, text=True, env={**os.environ, **env})
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and f"{url}/config.toml" in lines[0], refused.stderr[-2000:]
    assert "dipaco-run-" not in lines[0] and not list(tmp.glob("dipaco-run-*"))  # the killed one's too

    finish(start(command(shards_2x2, url, address=ray_cluster.address, rounds=ROUNDS, resume=True), env=env))
    assert not list(tmp.glob("dipaco-run-*"))
    assert_same_state(reference(shards_2x2, tmp_path_factory), local_copy(url), rounds=ROUNDS)


# ------------------------------------------------------------------------------------------------ a head of its own
class Head:
    """A Ray head as a user starts one: `RAY_AUTH_MODE=token ray start --head --block` on a fixed port, stopped
    (SIGTERM, as a service manager does) and started again on the same port."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc = port, log, None
        self.address = f"127.0.0.1:{port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "token"}

    def start(self) -> None:
        from dipaco.taskqueue.ray_cluster import reachable

        ray_cli = Path(sys.executable).with_name("ray")
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([str(ray_cli), "start", "--head", "--port", str(self.port), "--num-cpus", "2",
                                          "--node-ip-address", "127.0.0.1", "--include-dashboard", "false",
                                          "--disable-usage-stats", "--block"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: reachable(self.address) is None and "--block" in self.log.read_text().split("Ray runtime started")[-1],
                 "the head to start", timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    from dipaco.training.launch import free_port

    h = Head(free_port(), tmp_path_factory.mktemp("head") / "head.log")
    h.start()
    yield h
    h.stop()


def test_a_token_missing_or_wrong_is_one_line_within_seconds_and_writes_nothing(shards_2x2, head, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    for extra, says in (({}, "requires a token and this command has none"),
                        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}, "refused this command's token")):
        out = tmp_path / f"run{len(extra)}"
        began = time.time()
        done = subprocess.run(command(shards_2x2, out, address=head.address), capture_output=True, text=True,
                              env={**env, **extra}, timeout=120)
        lines = [x for x in done.stderr.splitlines() if x.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
        assert lines[0].startswith("dipaco train: error: ") and says in lines[0] and "RAY_AUTH_TOKEN" in lines[0]
        assert time.time() - began < 30 and not out.exists()  # Ray alone retried for 20 s, a warning a second
    with_keep_going = subprocess.run(command(shards_2x2, tmp_path / "kg", "--keep-going", address=head.address),
                                     capture_output=True, text=True, env=env, timeout=120)
    assert with_keep_going.returncode == 2 and "requires a token" in with_keep_going.stderr  # not a loss: it ends
    assert not (tmp_path / "kg").exists()


def test_keep_going_waits_out_a_head_stopped_and_restarted(shards_2x2, head, tmp_path, tmp_path_factory):
    """`ray stop` of the head mid-run (round 2 under way) and `ray start --head` again on the same port a little
    later: the supervisor waits (one line), says when the cluster is back (one line), and a new driver resumes
    from storage to the in-process run's bits."""
    out = tmp_path / "run"
    delays = ",".join(f"{i}:1:20" for i in range(4))  # round 2's first attempts sleep: the head stops under them
    proc = start(command(shards_2x2, out, "--keep-going", address=head.address, rounds=ROUNDS),
                 env={"RAY_AUTH_MODE": "token", **fault_env(delays, tmp_path / "faults")})
    wait_for(lambda: (out / "checkpoints" / "round_1").is_dir() and len(list(out.glob("queue/*/attempts/1/trainee_*"))) >= 2,
             "round 2 to start", timeout=240)
    head.stop()
    stopped = time.time()
    time.sleep(10)
    head.start()
    restarted = time.time()
    wait_for(lambda: (out / "checkpoints" / "round_2").is_dir(), "round 2 after the restart", timeout=240)
    recovered = time.time()
    _, err = finish(proc, timeout=300)
    assert_same_state(reference(shards_2x2, tmp_path_factory), out, rounds=ROUNDS)
    assert err.count("waiting for the Ray cluster") == 1 and err.count("answers again") == 1, err[-3000:]
    assert "error" not in err, err[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["kind"] == "round"] == [1, 2]
    print(f"\nhead down {restarted - stopped:.1f} s; round 2 checkpointed {recovered - restarted:.1f} s after the "
          f"restart\n{err}")
