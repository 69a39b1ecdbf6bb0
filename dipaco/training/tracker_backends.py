"""The two tracker backends behind ``dipaco.training.trackers``: TensorBoard event files and a Weights & Biases run.
Each takes named scalars at a step, a table, and a series on an axis of its own; neither knows what a round is.

Both packages are optional extras (``.[tensorboard]``, ``.[wandb]``): ``require`` checks them before any work
starts, so a missing one costs one line, not a trained round.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from dipaco.errors import DipacoError


def require(names: list[str]) -> None:
    """A one-line error naming the extra of the first tracker in ``names`` whose package is missing."""
    for name in names:
        try:
            importlib.import_module(name)  # the tracker's package has the tracker's name (and so has its extra)
        except ImportError:
            raise DipacoError(f"--log-to {name} needs the {name} package: pip install -e '.[{name}]'") from None


class TensorBoardWriter:
    """Event files in one directory; a later process appends new event files to the same directory, which
    TensorBoard reads as one run."""

    def __init__(self, directory: Path):
        require(["tensorboard"])
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
        self.writer.add_text(tag, "\n".join(lines), step)
        self.writer.flush()

    def series(self, values: dict[str, float], axis: str) -> None:
        """Scalars whose step is ``values[axis]`` (whole units: seconds of serving), apart from the rounds."""
        step = int(values[axis])
        for tag, value in values.items():
            if tag != axis:
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """One W&B run, resumed by its id: every process that logs to the run directory's tracker run passes the same id
    (kept in the run directory by ``dipaco.training.trackers``). With WANDB_MODE=offline it writes its files under
    ``RUN/wandb/`` and needs no network (``wandb sync`` uploads them later)."""

    def __init__(self, run_dir: Path, project: str, run_id: str, name: str, config: dict | None):
        require(["wandb"])
        import wandb

        self.wandb, self.axes = wandb, set()
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", dir=str(run_dir), name=name,
                                  config=config, settings=settings)
        except Exception as exc:  # W&B's own errors are many and unexported; any of them means: it did not start
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise DipacoError(f"--log-to wandb: W&B did not start ({first}); run `wandb login`, or set "
                              f"WANDB_MODE=offline to write the run under {run_dir / 'wandb'} without a network") from None

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({tag: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def series(self, values: dict[str, float], axis: str) -> None:
        """Scalars plotted against ``values[axis]``: W&B's own step is left to count, so rounds are never reused."""
        if axis not in self.axes:
            prefix = axis.split("/", 1)[0]
            self.run.define_metric(f"{prefix}/*", step_metric=axis)
            self.axes.add(axis)
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
