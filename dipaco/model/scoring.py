"""Per-document loss under a path model, batched, without gradients.

A document of n tokens is cut into windows of ``seq_len`` inputs (each target scored exactly once,
non-overlapping windows). Targets at positions < ``context`` (the routing prefix) are not scored.
Target position t is the token ``ids[t]`` predicted from ``ids[window start:t]``; window j holds the
inputs ``ids[j*seq_len:(j+1)*seq_len]`` and the targets ``j*seq_len+1 .. (j+1)*seq_len``.
"""

from __future__ import annotations

import numpy as np
import torch


def window_of(t: int, seq_len: int) -> int:
    """The window that scores target position t (t >= 1)."""
    return (t - 1) // seq_len


def windows_for(lo: int, hi: int, seq_len: int) -> range:
    """Windows needed to score target positions [lo, hi) (lo >= 1)."""
    return range(window_of(lo, seq_len), window_of(hi - 1, seq_len) + 1) if hi > lo else range(0)


@torch.inference_mode()
def window_nll(model, docs: list[list[int]], wanted: list[tuple[int, int]], seq_len: int, batch_size: int,
               pad_id: int = 0, progress=None) -> dict[tuple[int, int], np.ndarray]:
    """Next-token NLL (nats) of every target of the wanted (doc, window) pairs: {(d, j): array}.

    Windows are sorted by length so a batch carries little padding; right padding needs no attention
    mask in a causal model (real tokens never attend to later positions).
    """
    model.eval()
    items = sorted(wanted, key=lambda dw: -min(seq_len, len(docs[dw[0]]) - 1 - dw[1] * seq_len))
    out: dict[tuple[int, int], np.ndarray] = {}
    for b in range(0, len(items), batch_size):
        chunk = items[b:b + batch_size]
        rows = [docs[d][j * seq_len:(j + 1) * seq_len + 1] for d, j in chunk]
        width = max(len(r) for r in rows) - 1
        inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
        targets = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            t = torch.as_tensor(r, dtype=torch.long)
            inputs[i, :len(r) - 1] = t[:-1]
            targets[i, :len(r) - 1] = t[1:]
        nll = _target_nll(model, inputs, targets).numpy()
        for i, (key, r) in enumerate(zip(chunk, rows)):
            out[key] = nll[i, :len(r) - 1].copy()  # float32: the cache holds every window of every path
        if progress is not None:
            progress.update(len(chunk))
    return out


def _target_nll(model, inputs: torch.Tensor, targets: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """NLL of every target (0 where the target is -100): the head runs on ``rows`` positions at a time.

    Chunking keeps each slice of vocabulary logits in cache instead of materialising the full (batch, width,
    vocab) logits, which costs memory traffic; the numbers are the same up to rounding.
    """
    hidden = model.base_model(input_ids=inputs).last_hidden_state
    hidden, flat = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    head, out = model.get_output_embeddings(), torch.zeros(flat.shape, dtype=torch.float32)
    for a in range(0, len(flat), rows):
        logits, t = head(hidden[a:a + rows]).float(), flat[a:a + rows]
        out[a:a + rows] = torch.logsumexp(logits, -1) - logits.gather(-1, t.clamp(min=0)[:, None])[:, 0]
    return out.masked_fill_(flat == -100, 0.0).reshape(targets.shape)


def document_nll(model, docs: list[list[int]], context: int, seq_len: int, batch_size: int,
                 pad_id: int = 0) -> list[tuple[float, int]]:
    """(sum of next-token NLL in nats, number of scored tokens) for every document."""
    lo = max(1, context)
    wanted = [(d, j) for d, ids in enumerate(docs) for j in windows_for(lo, len(ids), seq_len)]
    nll = window_nll(model, docs, wanted, seq_len, batch_size, pad_id)
    totals = []
    for d, ids in enumerate(docs):
        s, n = 0.0, 0
        for j in windows_for(lo, len(ids), seq_len):
            first = j * seq_len + 1  # target position of the window's first target
            scored = nll[(d, j)][max(0, lo - first):]
            s, n = s + float(scored.sum(dtype=np.float64)), n + len(scored)
        totals.append((s, n))
    return totals
