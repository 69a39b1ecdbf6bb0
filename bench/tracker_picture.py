"""The picture of docs/training.md (Watching a run): a real run's tracker scalars, read back from its TensorBoard event
files with the tensorboard package's reader and drawn with matplotlib.

    python bench/tracker_picture.py [--run RUN] [--rounds 12] [--H 25] [--out docs/tracker_scalars.png]

Without --run it trains one: a DiPaCo 2x2 run (the `tiny` preset, the shared corpus's first documents or the default
corpus, as bench/worker_speed.py shards them) with ``dipaco train --log-to tensorboard``, then reads RUN/tensorboard/.
Six panels, one per kind of scalar: training loss per path, validation perplexity per path, and per module the outer
gradient's norm, the outer update's norm and the momentum's norm; the last panel shows tokens/s. Writes the PNG and
bench/tracker_picture.json (the command line and the run's last round, for the docs' figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_speed import make_shards  # noqa: E402

HERE = Path(__file__).resolve().parent
PANELS = [("train_loss/", "training loss per path", "nats/token"), ("val_ppl/", "validation perplexity per path", ""),
          ("outer_grad_norm/", "outer-gradient norm per module", "L2"), ("update_norm/", "outer update norm per module", "L2"),
          ("momentum_norm/", "momentum norm per module", "L2"), ("speed/tokens_per_s", "training tokens/s", "tokens/s")]


def train(work: Path, rounds: int, H: int) -> tuple[Path, list[str]]:
    shards, _ = make_shards(work)
    run = work / "run"
    cmd = ["dipaco", "train", "--shards", str(shards), "--out", str(run), "--preset", "tiny", "--rounds", str(rounds),
           "--inner-steps", str(H), "--log-to", "tensorboard", "--quiet"]
    subprocess.run([sys.executable, "-m", "dipaco.cli", *cmd[1:]], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run, cmd


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def draw(values: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (prefix, name, unit) in zip(axes.flat, PANELS):
        for tag in sorted(t for t in values if t.startswith(prefix) and not t.endswith(("/mean", "/of_mean_loss"))):
            steps, ys = zip(*values[tag])
            ax.plot(steps, ys, marker=".", label=tag[len(prefix):] or tag)
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.set_ylabel(unit)
        if prefix.startswith("val_ppl"):
            ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.savefig(out, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--run", help="a run trained with --log-to tensorboard (default: train one)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--H", type=int, default=25)
    p.add_argument("--out", default=str(HERE.parent / "docs" / "tracker_scalars.png"))
    p.add_argument("--title", help="the picture's title (default: the training command, or the run's path)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, cmd = (Path(args.run), None) if args.run else train(Path(tmp), args.rounds, args.H)
        values = scalars(run)
        title = args.title or (" ".join(cmd).replace(tmp + "/", "") if cmd else str(run))
        draw(values, Path(args.out), title)
        last = {tag: series[-1][1] for tag, series in values.items()}
    summary = {"command": cmd, "title": title, "rounds": max(s for series in values.values() for s, _ in series), "tags": len(values),
               "last_round": last}
    (HERE / "tracker_picture.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{len(values)} scalar tags over {summary['rounds']} rounds -> {args.out}")


if __name__ == "__main__":
    main()
