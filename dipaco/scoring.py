"""Per-document loss under a path model, batched, without gradients.

A document of n tokens is cut into windows of ``seq_len`` inputs (each target scored exactly once,
non-overlapping windows). Targets at positions < ``context`` (the routing prefix) are not scored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def document_nll(model, docs: list[list[int]], context: int, seq_len: int, batch_size: int,
                 pad_id: int = 0) -> list[tuple[float, int]]:
    """(sum of next-token NLL in nats, number of scored tokens) for every document."""
    windows = []  # (doc index, first input position, input ids)
    for d, ids in enumerate(docs):
        for start in range(0, max(0, len(ids) - 1), seq_len):
            if start + seq_len >= context:  # a window with no scored target is skipped
                windows.append((d, start, ids[start:start + seq_len + 1]))
    totals = [[0.0, 0] for _ in docs]
    model.eval()
    for b in range(0, len(windows), batch_size):
        chunk = windows[b:b + batch_size]
        width = max(len(w[2]) for w in chunk) - 1
        inputs = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        targets = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (_, start, ids) in enumerate(chunk):
            ids_t = torch.as_tensor(ids, dtype=torch.long)
            n = len(ids) - 1
            inputs[row, :n] = ids_t[:-1]
            targets[row, :n] = ids_t[1:]
            # target j sits at document position start + j + 1; the first `context` positions are not scored
            unscored = max(0, min(n, context - start - 1))
            targets[row, :unscored] = -100
        logits = model(input_ids=inputs).logits.float()
        nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        scored = targets != -100
        for row, (d, _, _) in enumerate(chunk):
            totals[d][0] += nll[row][scored[row]].sum().item()
            totals[d][1] += int(scored[row].sum())
    return [(t[0], t[1]) for t in totals]
