"""Communication between workers. The only file that may import torch.distributed.

This version runs every trainee in one process (a "world of one"): a module's outer gradient is
already complete on the only worker, so the reduction is the identity and nothing crosses a wire.
The interface is what the multi-process engine implements: ``reduce_module`` sums a module's
partial weighted outer gradient over the workers that hold the module, and counts bytes.
"""

from __future__ import annotations

import torch


class LocalWorld:
    """All trainees in this process; reductions are no-ops and move zero bytes."""

    rank = 0
    size = 1

    def __init__(self):
        self.bytes_sent = 0
        self.bytes_received = 0

    def reduce_module(self, module: str, tensors: dict[str, torch.Tensor]) -> None:
        """Sum ``tensors`` in place over the workers holding ``module`` (here: only this one)."""

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
