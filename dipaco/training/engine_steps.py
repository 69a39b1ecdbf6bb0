"""The steps of a round that every training engine takes the same way, defined once: the in-process and torchrun
engine (``dipaco.training.train``, ``dipaco.training.sync``) and the Ray engine call these, so the two cannot drift apart. (Round 0's
weights, the fourth shared step, are ``dipaco.storage.run.initial_modules``: they belong to the run directory's creation.)

  ``inner_record``      the ``kind="inner"`` line of metrics.jsonl for one inner step, when one is due
  ``rescale_and_step``  a module's averaged outer gradient: the optional √P rescaling, then the outer Nesterov step
  ``round_line``        the ``kind="round"`` line of metrics.jsonl: the fields every engine writes, then its own
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dipaco.training.outer import OuterOptimizer, sqrt_rescale

if TYPE_CHECKING:  # annotations only: this file stays on the lowest floors (dipaco.training.sync imports it)
    from dipaco.config import TrainConfig


def inner_record(cfg: TrainConfig, trainee, round: int, loss: float) -> dict | None:
    """The metrics line of the inner step ``trainee`` just took in ``round`` (1-based), or None when its step is not
    one of every ``cfg.log_every``."""
    if not cfg.log_every or trainee.step % cfg.log_every:
        return None
    return dict(kind="inner", round=round, step=trainee.step, trainee=trainee.index, path=trainee.path, loss=loss,
                lr=trainee.optimizer.param_groups[0]["lr"])


@torch.no_grad()
def rescale_and_step(outer: OuterOptimizer, module: str, grad: dict[str, torch.Tensor], sqrt: bool,
                     paths_through: int) -> None:
    """Apply module ``module``'s averaged outer gradient ``grad`` (modified in place): rescaled by √(paths through the
    module) when ``sqrt`` (DiPaCo §2.7), then the outer Nesterov step on its global weights."""
    if sqrt:
        sqrt_rescale(grad, paths_through)
    outer.step(module, grad)


def round_line(r: int, train_loss_by_trainee: list[float | None], val: dict[str, float], seconds: float, tokens: int,
               workers: int, bytes_sent: int, bytes_received: int, engine: str | None = None, **extra) -> dict:
    """The ``kind="round"`` metrics line of round ``r``: the mean training loss over the trainees that reported one (a
    dropped phase has none), the validation losses and their mean, the round's time, tokens and bytes; ``engine`` (when
    given) after the round, ``extra`` (each engine's own fields) last."""
    losses = [x for x in train_loss_by_trainee if x is not None]
    line = dict(kind="round", round=r) | ({"engine": engine} if engine is not None else {})
    return line | dict(train_loss=sum(losses) / len(losses) if losses else None,
                       train_loss_by_trainee=train_loss_by_trainee, val_loss=val,
                       val_loss_mean=(sum(val.values()) / len(val)) if val else None, seconds=seconds, tokens=tokens,
                       tokens_per_s=tokens / seconds if seconds > 0 else None, workers=workers, bytes_sent=bytes_sent,
                       bytes_received=bytes_received) | extra
