"""Every per-document choice of the shard stage, as a function of the document's content and the seed.

A document is known by its *digest* (128-bit blake2b of its cleaned text, the dedup key too). One keyed
hash of the digest under the seed gives three independent 128-bit keys, read as big-endian integers:

  role key    held-out if below ``heldout_fraction`` of the key space, router document if in the next
              ``router_fraction``, training otherwise; when there are more candidates than a cap, the
              ones with the smallest keys are kept (the others train): a uniform subset of the candidates
  val key     a training document validates its path if below ``val_fraction``
  sample key  the fit sample (tokenizer and router) is the ``fit_sample`` training documents of
              smallest sample key (a bottom-k: a uniform sample without replacement)

None of this depends on where a document sits in the stream or which worker reads it, and a bottom-k is
mergeable: the bottom-k of a union is the bottom-k of the parts' bottom-k's. So any split of the corpus
into blocks reaches the same roles, the same sample and (in the sample's key order) the same fits. The
path comes from the fitted router; exact duplicates are resolved by their position (``sharding.dedup``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

DROPPED, TRAIN, HELDOUT, ROUTER = 0, 1, 2, 3
KEY_BYTES = 16
_SPACE = 1 << (8 * KEY_BYTES)


def digest(text: str) -> bytes:
    """The document's identity: 128-bit blake2b of its cleaned text (UTF-8, lone surrogates replaced)."""
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=16).digest()


def keys(doc_digest: bytes, seed: int) -> tuple[int, int, int]:
    """(role key, val key, sample key) of a document: 128-bit integers from one hash keyed by the seed."""
    h = hashlib.blake2b(doc_digest, digest_size=3 * KEY_BYTES, key=int(seed).to_bytes(8, "big", signed=True),
                        person=b"dipaco-shard").digest()
    return (int.from_bytes(h[:KEY_BYTES], "big"), int.from_bytes(h[KEY_BYTES:2 * KEY_BYTES], "big"),
            int.from_bytes(h[2 * KEY_BYTES:], "big"))


def below(fraction: float) -> int:
    """The key below which a share ``fraction`` of the key space lies."""
    return int(fraction * _SPACE)


class BottomK:
    """The ``k`` smallest keys seen (each with a payload), mergeable across workers.

    Equal keys are one document seen twice (a duplicate, or a merge of overlapping parts) and count once
    unless ``distinct`` is False (the corpus keeps duplicates: each copy is a document). Amortised: items
    under the current k-th key are appended and the list is cut back to k when it doubles."""

    def __init__(self, k: int, distinct: bool = True, limit: int | None = None):
        self.k, self.distinct = int(k), distinct
        self.items: list[tuple[int, object]] = []
        # the k-th smallest key once k are known (or a bound known from elsewhere): larger keys cannot enter
        self.limit: int | None = limit

    def offer(self, key: int, payload: object = None) -> None:
        if self.k <= 0 or (self.limit is not None and key > self.limit):
            return
        self.items.append((key, payload))
        if len(self.items) >= 2 * self.k + 64:
            self._cut()

    def merge(self, other: "BottomK") -> "BottomK":
        for key, payload in other.items:
            self.offer(key, payload)
        return self

    def _cut(self) -> None:
        self.items.sort(key=lambda kv: kv[0])
        if self.distinct:
            out, last = [], None
            for kv in self.items:
                if kv[0] != last:
                    out.append(kv)
                    last = kv[0]
            self.items = out
        del self.items[self.k:]
        if self.k and len(self.items) == self.k:
            self.limit = self.items[-1][0]

    def result(self) -> list[tuple[int, object]]:
        """The bottom-k, smallest key first."""
        self._cut()
        return list(self.items)

    def threshold(self) -> int | None:
        """The largest kept key once k keys are known (-1 when k is 0), or None when fewer came (none is cut)."""
        if self.k <= 0:
            return -1
        self._cut()
        return self.limit


@dataclass
class Roles:
    """The role rule of a corpus: the fractions, and the caps' key thresholds once the candidates are known.

    ``heldout_limit`` / ``router_limit``: the largest role key a held-out / router candidate may have to keep
    its role (None: no cap binds). Built by ``Roles.fit`` from the candidates' bottom-k's."""

    heldout_fraction: float
    router_fraction: float
    val_fraction: float
    heldout_limit: int | None = None
    router_limit: int | None = None
    _bounds: tuple[int, int, int] = field(init=False, repr=False)

    def __post_init__(self):
        self._bounds = (below(self.heldout_fraction), below(self.heldout_fraction + self.router_fraction),
                        below(self.val_fraction))

    def candidate(self, role_key: int) -> int:
        """The role a document's key asks for, before any cap: HELDOUT, ROUTER or TRAIN."""
        held, router, _ = self._bounds
        return HELDOUT if role_key < held else ROUTER if role_key < router else TRAIN

    def role(self, role_key: int) -> int:
        """The document's role once the caps are applied (a candidate past its cap trains)."""
        wanted = self.candidate(role_key)
        limit = self.heldout_limit if wanted == HELDOUT else self.router_limit if wanted == ROUTER else None
        return TRAIN if limit is not None and role_key > limit else wanted

    def is_val(self, val_key: int) -> bool:
        return val_key < self._bounds[2]

    def fit(self, heldout: BottomK, router: BottomK) -> "Roles":
        """The caps' thresholds from the bottom-k (k = cap) of the held-out and router candidates' role keys."""
        self.heldout_limit, self.router_limit = heldout.threshold(), router.threshold()
        return self
