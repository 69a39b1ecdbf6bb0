"""The Ray engine's speed against the in-process engine, on the same run on this machine.

    python bench/ray_engine.py [--quick] [--rounds 4] [--H 50] [--bits 4] [--workers 1 2]

Trains the same DiPaCo 2x2 run (the `tiny` preset, one torch thread per process, the same seed) with
``dipaco train`` (the in-process engine: four trainees in lockstep in one process) and with
``dipaco train --engine ray --workers N`` (a local Ray with N one-CPU workers), each in a fresh process, and
checks that the final weights are bit-identical. Tokens/s is over the steady state: the training tokens of rounds
2..R over the time from the end of round 1 to the end of round R (round 1 carries start-up: Ray, and a fresh
worker process importing torch); the table also gives it over the whole command. With one worker the Ray engine
has the in-process engine's one core, so their ratio is the engine's own cost; with two it uses both cores.
A phase's time is split into loading (modules and trainee state from the run directory, the model reused),
validation, the H inner steps and saving (outer gradients at ``--bits`` and the trainee state), from the
metrics every phase reports.

Shards: a 2x2 shard directory made once from the first documents of every file of ``$DIPACO_CORPUS`` or
``../shared/corpus``, else from the default corpus. Prints a table; writes ``bench/out/ray_engine.json`` (the
measured inputs of ``bench/elastic.py``) and ``bench/ray_engine_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_speed import make_shards  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def run(shards: Path, out: Path, rounds: int, H: int, bits: int, engine: list[str]) -> dict:
    """One training command in a fresh process; its wall time and its round lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(out), "--preset", "tiny",
           "--rounds", str(rounds), "--inner-steps", str(H), "--bits", str(bits), "--quiet", *engine]
    began = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "rounds": [r for r in rows if r["kind"] == "round"]}


def steady(result: dict) -> dict:
    rounds = result["rounds"]
    later = rounds[1:]
    tokens = sum(r["tokens"] for r in later)
    seconds = sum(r["seconds"] for r in later)
    total = sum(r["tokens"] for r in rounds)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_s_whole_command": total / result["wall_s"]}


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    last = (a / "checkpoints" / "latest").read_text().strip()
    for f in sorted((a / "checkpoints" / last / "modules").glob("*.safetensors")):
        ta, tb = load_file(str(f)), load_file(str(b / "checkpoints" / last / "modules" / f.name))
        if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def phase_times(result: dict) -> dict:
    phases = [p for r in result["rounds"][1:] for p in r["phases"] if not p.get("dropped")]
    mean = {k: sum(p[k] for p in phases) / len(phases) for k in ("load_s", "val_s", "compute_s", "save_s")}
    return mean | {"phases": len(phases), "bytes_sent": phases[0]["bytes_sent"], "bytes_loaded": phases[0]["bytes_loaded"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8, 16, 32])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--quick", action="store_true", help="2 rounds of H = 20 (a smoke run)")
    ap.add_argument("--work", default=str(OUT / "ray_engine"))
    args = ap.parse_args(argv)
    rounds, H = (2, 20) if args.quick else (args.rounds, args.H)
    if rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 carries start-up and is not timed)")
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit("bench/ray_engine.py: needs Ray; pip install -e '.[ray]'")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shards, source = make_shards(work)
    tag = f"r{rounds}-h{H}-b{args.bits}"
    results = {}
    local = work / f"local-{tag}"
    if local.exists():
        subprocess.run(["rm", "-rf", str(local)], check=True)
    results["in-process"] = run(shards, local, rounds, H, args.bits, [])
    for w in args.workers:
        out = work / f"ray{w}-{tag}"
        if out.exists():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        results[f"ray, {w} worker{'s' * (w > 1)}"] = run(shards, out, rounds, H, args.bits, ["--engine", "ray", "--workers", str(w)])
        results[f"ray, {w} worker{'s' * (w > 1)}"]["bit_identical"] = same_weights(local, out)
        results[f"ray, {w} worker{'s' * (w > 1)}"]["run"] = out

    base = steady(results["in-process"])
    print(f"\nDiPaCo 2x2, tiny preset, H = {H}, {rounds} rounds, {args.bits}-bit outer gradients; shards: {source}\n")
    print("| engine | tokens/s (rounds 2..R) | vs in-process | tokens/s (whole command) | wall s | bit-identical |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    summary = {"config": {"preset": "tiny", "grid": "2x2", "rounds": rounds, "inner_steps": H, "bits": args.bits,
                          "source": source}, "engines": {}}
    for name, res in results.items():
        s = steady(res)
        ratio = s["tokens_per_s"] / base["tokens_per_s"]
        print(f"| {name} | {s['tokens_per_s']:.0f} | {ratio:.3f}x | {s['tokens_per_s_whole_command']:.0f} | "
              f"{res['wall_s']:.1f} | {res.get('bit_identical', '-')} |")
        summary["engines"][name] = {**s, "ratio": ratio, "wall_s": res["wall_s"], "bit_identical": res.get("bit_identical")}
    print("\nA phase (mean over rounds 2..R), seconds:\n")
    print("| engine | load | validate | H inner steps | save | load + save share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, res in results.items():
        if "run" not in res:
            continue
        t = phase_times(res)
        share = (t["load_s"] + t["save_s"]) / (t["load_s"] + t["val_s"] + t["compute_s"] + t["save_s"])
        print(f"| {name} | {t['load_s']:.3f} | {t['val_s']:.3f} | {t['compute_s']:.3f} | {t['save_s']:.3f} | {share:.1%} |")
        summary["engines"][name]["phase"] = t
    one = next(res for name, res in results.items() if "run" in res)
    t = phase_times(one)
    info = json.loads((one["run"] / "run.json").read_text())
    state = one["run"] / "checkpoints" / f"round_{rounds}" / "state" / "trainee_0.pt"
    # the measured inputs of bench/elastic.py
    summary.update({"phase_compute_s": t["compute_s"], "phase_load_s": t["load_s"], "phase_save_s": t["save_s"],
                    "phase_val_s": t["val_s"], "path_parameters": info["parameters"]["per_path"],
                    "outer_gradient_bytes_per_phase": t["bytes_sent"], "module_bytes_per_phase": t["bytes_loaded"],
                    "trainee_state_bytes": state.stat().st_size, "inner_steps": H, "bits": args.bits})
    OUT.mkdir(exist_ok=True)
    for f in (OUT / "ray_engine.json", Path(__file__).resolve().parent / "ray_engine_results.json"):
        f.write_text(json.dumps(summary, indent=1, default=str))
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
