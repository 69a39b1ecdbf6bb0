"""The internet-scale picture, simulated: DiPaCo's task queue (``--engine ray``) against one synchronous job, with
workers that are preempted.

    python bench/elastic.py [--quick] [--scale measured|paper] [--paths 256] [--workers 16 32 64]
                            [--rates 0 0.01 0.05 0.1 0.2 0.5] [--seeds 5] [--rounds R] [--FLAG VALUE ...]

A discrete-event model of R outer rounds of a DiPaCo grid (16x16 = 256 paths by default: two levels of 16
modules, a module of level l shared by 16 paths, plus an embedding/head shared by all paths unless
``--private-embedding``) on W workers, each preempted at a Poisson rate λ per worker-hour and replaced after
``--replace-s`` seconds by a worker that needs ``--startup-s`` seconds before its first task.

Task queue (the Ray engine): a phase (path, round) = load the path's modules and its trainee state from shared
storage, H inner steps (``phase compute``, times a log-normal jitter per phase), save the outer gradient (at
``--bits``) and the state. Any idle worker takes the ready phase of the lowest round (then the lowest path); a
phase is ready when its modules have that round's version and its previous phase is done; a module's outer step
(executor time: its inputs and output over storage) starts when every phase of its paths is in; no other barrier.
A preempted worker's phase is lost (its time wasted) and goes back to the queue. Executors and storage never fail;
an executor has its own link to storage, as fast as a worker's. Sticky rows: a ready phase goes to the idle worker
that holds its trainee's state (read from that worker's cache, not storage); with ``checkpoint every K`` the state
goes to storage only every K rounds, and a phase that misses the cache reads the last durable state and replays the
phases since (their modules read again, their compute counted as wasted).

Synchronous job (the torchrun engine with --max-restarts): every worker holds ceil(P/W) trainees in memory and
runs them in lockstep; a round ends with the slowest worker, then a ring all-reduce of the outer gradients over
``--net-mbit``; a checkpoint (modules and trainee states to storage) every ``--checkpoint-every`` rounds. Any
worker lost stops the whole job: it waits for the replacement, restarts every worker (``--startup-s`` plus
reading the checkpoint) and redoes every round since the last checkpoint.

A run not finished after ``--horizon-h`` hours is stopped (a synchronous job that loses a worker more often than
it can finish a checkpointed stretch never ends): its utilisation counts the rounds it kept.
Utilisation = the compute the run needs (P·R phases' inner steps) / (W workers × wall-clock): time spent loading
and saving, waiting, restarting and redoing lost work is not useful. Inputs: ``--scale measured`` takes phase
time and bytes from ``bench/out/ray_engine.json`` (``bench/ray_engine.py``; else its committed copy
``bench/ray_engine_results.json``); ``--scale paper`` assumes the DiPaCo paper's path (150M parameters, fp32
weights, AdamW state kept in storage, a phase of 150 inner steps taking 5 minutes, the embedding 20% of a path).
The measured scale's tiny path has its embedding at 55% of the parameters. Every number can be overridden
by its flag. Prints a table (mean ± sd over seeds) and writes ``elastic.json`` and ``elastic.png`` to ``--out``
(default ``bench/out``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"


@dataclass
class Model:
    paths_per_level: int = 16        # a K x K grid: P = K^2 paths
    shared_global: bool = True       # an embedding/head module every path uses (DiPaCo's default here)
    rounds: int = 16
    phase_compute_s: float = 300.0   # H inner steps of one path
    jitter: float = 0.1              # sigma of a log-normal factor on every phase's compute
    module_bytes: float = 600e6      # a path's modules (fp32): what a phase loads
    state_bytes: float = 1.2e9       # a trainee's state (AdamW moments): loaded and saved by every phase
    payload_bytes: float = 77e6      # a path's outer gradient at --bits: what a phase sends
    global_fraction: float = 0.2     # the shared embedding/head's share of a path's parameters (the levels share the rest)
    storage_mbit: float = 1000.0     # per worker, to the shared storage
    net_mbit: float = 1000.0         # per worker, between workers (the synchronous job's all-reduce)
    latency_s: float = 0.05          # per storage access
    startup_s: float = 60.0          # a worker process starting (imports, model build)
    replace_s: float = 120.0         # a preempted worker's replacement joins after this
    checkpoint_every: int = 1        # rounds between the synchronous job's checkpoints
    horizon_h: float = 2000.0        # a run still unfinished then is stopped and reported as such
    sticky: bool = False             # a phase prefers the worker that trained its trainee last (a soft affinity)
    #                                  and reads the state from that worker's cache; storage keeps the durable copy
    state_every: int = 1             # sticky: rounds between a trainee's durable states (the run's checkpoint_every);
    #                                  in between only the worker's cache holds it, and a phase elsewhere replays

    @property
    def paths(self) -> int:
        return self.paths_per_level ** 2

    def transfer_s(self, nbytes: float, mbit: float | None = None) -> float:
        return nbytes * 8 / ((mbit or self.storage_mbit) * 1e6) + self.latency_s


def phase_modules(m: Model, p: int) -> list[str]:
    k = m.paths_per_level
    return [f"L0.E{p // k}", f"L1.E{p % k}"] + (["global"] if m.shared_global else [])


def module_fraction(m: Model, mod: str) -> float:
    """A module's share of a path's parameters (and so of its bytes)."""
    if mod == "global":
        return m.global_fraction
    return (1.0 - (m.global_fraction if m.shared_global else 0.0)) / 2


def module_paths(m: Model) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in range(m.paths):
        for mod in phase_modules(m, p):
            out.setdefault(mod, []).append(p)
    return out


# ------------------------------------------------------------------------------------------------- task queue
def simulate_queue(m: Model, workers: int, rate_per_hour: float, seed: int, log: list | None = None) -> dict:
    """The task queue; ``log`` (if given) receives (time, event, ...) tuples for invariant checks."""
    rng = random.Random(seed)
    users = module_paths(m)
    durable = lambda v: not m.sticky or v % m.state_every == 0 or v >= m.rounds  # noqa: E731 (the state at v in storage)
    # an executor reads its module's share of every path's payload, reads the module and writes its new version
    step_s = {mod: m.transfer_s(module_fraction(m, mod) * (len(ps) * m.payload_bytes + 2 * m.module_bytes))
              for mod, ps in users.items()}
    version = {mod: 0 for mod in users}           # the module's latest version
    done_at: dict[int, int] = {p: 0 for p in range(m.paths)}  # rounds of phases done per path
    in_round: dict[tuple[str, int], int] = {}     # (module, round) -> phases of it done
    ready: list[tuple[int, int]] = [(0, p) for p in range(m.paths)]
    heapq.heapify(ready)
    events: list = []
    seq = 0

    def push(t, kind, *args):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, args))
        seq += 1

    idle: list[int] = []
    epoch = [0] * workers           # a preempted worker's pending events are stale
    running: dict[int, tuple] = {}  # worker -> (path, round, start, compute)
    cached: dict[int, tuple[int, int]] = {}  # path -> (worker, its epoch) holding the trainee's state
    durable_at: dict[int, int] = {p: 0 for p in range(m.paths)}  # path -> the round of its last durable state

    def home(x: tuple[int, int]) -> int | None:  # the live worker caching ready phase x's trainee state
        w, e = cached.get(x[1], (-1, 0))
        return w if m.sticky and w >= 0 and e == epoch[w] else None

    storage_bytes = 0.0
    for w in range(workers):
        push(m.startup_s, "join", w, 0)
    useful = wasted = 0.0
    preemptions = 0
    now = 0.0
    while events and min(version.values()) < m.rounds:
        now, _, kind, args = heapq.heappop(events)
        if kind == "join":
            w, e = args
            if e != epoch[w]:
                continue
            idle.append(w)
            if rate_per_hour > 0:
                push(now + rng.expovariate(rate_per_hour / 3600), "preempt", w, e)
        elif kind == "preempt":
            w, e = args
            if e != epoch[w]:
                continue
            preemptions += 1
            epoch[w] += 1
            if w in running:  # its phase is lost
                p, r, start, _ = running.pop(w)
                wasted += now - start
                heapq.heappush(ready, (r, p))
            if w in idle:
                idle.remove(w)
            push(now + m.replace_s + m.startup_s, "join", w, epoch[w])
        elif kind == "phase_done":
            w, e = args
            if e != epoch[w]:
                continue
            p, r, start, compute = running.pop(w)
            useful += compute
            idle.append(w)
            done_at[p] = r + 1
            if durable(r + 1):
                durable_at[p] = r + 1
            if log is not None:
                log.append((now, "phase_done", p, r))
            for mod in phase_modules(m, p):
                in_round[(mod, r)] = in_round.get((mod, r), 0) + 1
                if in_round[(mod, r)] == len(users[mod]):
                    push(now + step_s[mod], "step_done", mod, r + 1)
        elif kind == "step_done":
            mod, v = args
            version[mod] = v
            if log is not None:
                log.append((now, "version", mod, v))
            for p in users[mod]:
                if v < m.rounds and done_at[p] == v and all(version[x] >= v for x in phase_modules(m, p)):
                    heapq.heappush(ready, (v, p))
        while idle and ready:
            # sticky: a ready phase whose trainee's state sits on an idle worker goes there (lowest round first);
            # the rest, like every phase without it, to the first idle worker (the affinity is soft), except a
            # phase whose state is only in a live worker's cache: it waits for that worker rather than replay
            free = [x for x in sorted(ready) if home(x) in idle or home(x) is None or durable_at[x[1]] == x[0]]
            if not free:
                break
            at_home = [x for x in free if home(x) in idle]
            r, p = at_home[0] if at_home else free[0]
            ready.remove((r, p))
            heapq.heapify(ready)
            hit = bool(at_home)
            w = cached[p][0] if hit else idle[0]
            idle.remove(w)
            compute = m.phase_compute_s * rng.lognormvariate(0.0, m.jitter)
            replay = 0 if hit else r - durable_at[p]  # a miss between durable states: those phases again
            running[w] = (p, r, now, compute)
            cached[p] = (w, epoch[w])
            loaded = m.module_bytes if hit else (1 + replay) * m.module_bytes + m.state_bytes
            saved = m.payload_bytes + (m.state_bytes if durable(r + 1) else 0)
            storage_bytes += loaded + saved
            wasted += replay * m.phase_compute_s
            if log is not None:
                log.append((now, "phase_start", p, r, tuple(version[x] for x in phase_modules(m, p))))
            took = m.transfer_s(loaded) + replay * m.phase_compute_s + compute + m.transfer_s(saved)
            push(now + took, "phase_done", w, epoch[w])
    return {"wall_s": now, "utilisation": m.paths * m.rounds * m.phase_compute_s / (workers * now), "finished": True,
            "rounds_kept": m.rounds, "useful_s": useful, "wasted_s": wasted, "preemptions": preemptions,
            "storage_bytes_per_phase": storage_bytes / max(1, sum(done_at.values()))}


# ------------------------------------------------------------------------------------------------- synchronous job
def simulate_sync(m: Model, workers: int, rate_per_hour: float, seed: int) -> dict:
    rng = random.Random(seed)
    per_worker = math.ceil(m.paths / workers)
    ring = 2 * (workers - 1) / workers * per_worker * m.payload_bytes if workers > 1 else 0.0
    allreduce = m.transfer_s(ring, m.net_mbit) if workers > 1 else 0.0
    checkpoint_s = m.transfer_s(per_worker * (m.module_bytes + m.state_bytes))
    restart_s = m.startup_s + checkpoint_s  # every worker starts and reads its part of the checkpoint
    rate = workers * rate_per_hour / 3600
    now, kept, wasted, preemptions = m.startup_s, 0, 0.0, 0
    next_fail = now + rng.expovariate(rate) if rate else math.inf
    while kept < m.rounds:
        if now > m.horizon_h * 3600:  # it redoes lost rounds faster than it keeps any: stop, and say so
            return {"wall_s": now, "utilisation": m.paths * kept * m.phase_compute_s / (workers * now), "finished": False,
                    "rounds_kept": kept, "useful_s": m.paths * kept * m.phase_compute_s, "wasted_s": wasted,
                    "preemptions": preemptions}
        segment = range(kept, min(m.rounds, kept + m.checkpoint_every))  # the rounds up to the next checkpoint
        began, t = now, now
        lost = False
        for _ in segment:
            t += max(sum(m.phase_compute_s * rng.lognormvariate(0.0, m.jitter) for _ in range(per_worker))
                     for _ in range(workers)) + allreduce
            if t > next_fail:
                lost = True
                break
        if not lost:
            t += checkpoint_s
            lost = t > next_fail
        if lost:  # everything since the last checkpoint is redone after the replacement and a restart
            preemptions += 1
            wasted += workers * (next_fail - began)
            now = next_fail + m.replace_s + restart_s
            next_fail = now + rng.expovariate(rate)
            continue
        now, kept = t, kept + len(segment)
    return {"wall_s": now, "utilisation": m.paths * m.rounds * m.phase_compute_s / (workers * now), "finished": True,
            "rounds_kept": kept, "useful_s": m.paths * m.rounds * m.phase_compute_s, "wasted_s": wasted,
            "preemptions": preemptions}


# ------------------------------------------------------------------------------------------------- inputs, report
def measured_model(path: Path | None = None) -> tuple[Model, str]:
    """The phase time and bytes bench/ray_engine.py measured (a tiny CPU model), on a local disk."""
    for f in ([path] if path else [OUT / "ray_engine.json", HERE / "ray_engine_results.json"]):
        if f and f.is_file():
            d = json.loads(f.read_text())
            return Model(paths_per_level=16, rounds=16, phase_compute_s=d["phase_compute_s"],
                         module_bytes=d["module_bytes_per_phase"], state_bytes=d["trainee_state_bytes"],
                         payload_bytes=d["outer_gradient_bytes_per_phase"], global_fraction=0.55, latency_s=0.005,
                         startup_s=8.0, replace_s=30.0), str(f)
    raise SystemExit("bench/elastic.py: no measured inputs; run python bench/ray_engine.py first, or use --scale paper")


def _sticky(m: Model, workers: int, rate: float, seed: int) -> dict:
    return simulate_queue(replace(m, sticky=True), workers, rate, seed)


def _sticky_sparse(m: Model, workers: int, rate: float, seed: int) -> dict:
    return simulate_queue(replace(m, sticky=True, state_every=SPARSE), workers, rate, seed)


SPARSE = 4  # checkpoint_every of the sparse sticky row
ENGINES = (("task queue", simulate_queue), ("task queue, sticky", _sticky),
           (f"task queue, sticky, checkpoint every {SPARSE}", _sticky_sparse), ("synchronous", simulate_sync))


def sweep(m: Model, workers: list[int], rates: list[float], seeds: int) -> list[dict]:
    rows = []
    for w in workers:
        for lam in rates:
            for engine, sim in ENGINES:
                runs = [sim(m, w, lam, s) for s in range(seeds)]
                row = {"engine": engine, "workers": w, "rate_per_worker_hour": lam}
                row["finished"] = sum(r["finished"] for r in runs)
                row["seeds"] = len(runs)
                for k in ("wall_s", "utilisation", "wasted_s", "preemptions", "rounds_kept", "storage_bytes_per_phase"):
                    vals = [r.get(k, 0.0) for r in runs]
                    row[k] = statistics.fmean(vals)
                    row[k + "_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
                rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| workers | preemptions / worker-hour | engine | wall-clock h | utilisation | wasted worker-h | preemptions |"
          " storage MB / phase | finished |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        storage = "checkpoints only" if r["engine"] == "synchronous" else f"{r['storage_bytes_per_phase'] / 1e6:,.4g}"
        wall = (f"{r['wall_s'] / 3600:.2f} ± {r['wall_s_sd'] / 3600:.2f}" if r["finished"] == r["seeds"] else
                f"> {r['wall_s'] / 3600:.0f} (stopped)" if not r["finished"] else f"{r['wall_s'] / 3600:.0f}, some stopped")
        print(f"| {r['workers']} | {r['rate_per_worker_hour']:g} | {r['engine']} | {wall} | {r['utilisation']:.1%} ± "
              f"{r['utilisation_sd']:.1%} | {r['wasted_s'] / 3600:.1f} | {r['preemptions']:.1f} | "
              f"{storage} | {r['finished']}/{r['seeds']} |")


def plot(rows: list[dict], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 5.4))
    for w in sorted({r["workers"] for r in rows}):
        for engine, style in zip([e for e, _ in ENGINES], ("-o", ":^", "-.v", "--s")):
            sel = [r for r in rows if r["workers"] == w and r["engine"] == engine]
            x = [r["rate_per_worker_hour"] for r in sel]
            a.plot(x, [r["utilisation"] for r in sel], style, label=f"{engine}, {w} workers")
            b.plot(x, [r["wall_s"] / 3600 for r in sel], style, label=f"{engine}, {w} workers")
    a.set(xlabel="preemptions per worker-hour", ylabel="worker utilisation", ylim=(0, 1.05), title="utilisation")
    b.set(xlabel="preemptions per worker-hour", ylabel="wall-clock (hours)", yscale="log", title="time to finish")
    handles, labels = a.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--scale", choices=["measured", "paper"], default="paper")
    ap.add_argument("--inputs", type=Path, help="ray_engine.json to read with --scale measured")
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rates", type=float, nargs="+", default=[0, 0.01, 0.05, 0.1, 0.2, 0.5])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="workers 16 and 64, rates 0 and 0.1, 2 seeds")
    ap.add_argument("--out", type=Path, default=OUT, help="folder for elastic.json and elastic.png")
    for f in Model.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default) if f.type != "bool" else int, default=None)
    args = ap.parse_args(argv)
    m, source = measured_model(args.inputs) if args.scale == "measured" else (Model(), "the DiPaCo paper's path (assumed)")
    for name in Model.__dataclass_fields__:
        value = getattr(args, name)
        if value is not None:
            setattr(m, name, type(getattr(m, name))(value))
    if args.quick:
        args.workers, args.rates, args.seeds = [16, 64], [0, 0.1], 2
    if min(args.workers) < 1 or min(args.rates) < 0 or args.seeds < 1 or m.rounds < 1 or m.paths_per_level < 1:
        ap.error("workers, seeds, rounds and paths must be >= 1 and rates >= 0")
    rows = sweep(m, args.workers, args.rates, args.seeds)
    print(f"\n{m.paths} paths, {m.rounds} rounds; inputs: {source}")
    print("assumptions: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in asdict(m).items()))
    print()
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps({"model": asdict(m), "source": source, "rows": rows}, indent=1))
    plot(rows, f"{m.paths} paths, {m.rounds} rounds, phase {m.phase_compute_s:g} s ({source})", args.out / "elastic.png")
    print(f"\nwrote {args.out / 'elastic.json'} and {args.out / 'elastic.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
