"""The shard-directory format (read side) and the training batch sampler.

Layout written by ``dipaco.sharding.writer``::

    manifest.json            config, versions, counts, input hashes, fingerprint
    tokenizer/               a Hugging Face tokenizer
    router/                  the frozen router (dipaco.routing.Router)
    paths/<id>/train.bin     flat token ids (manifest's token_dtype), documents separated by EOS
    paths/<id>/train.idx     int64 start offset of every document, plus the end
    paths/<id>/val.bin|idx   the same for the path's validation documents
    heldout/docs.jsonl       whole held-out documents {"text", "label", "path"} for routed evaluation
    router_docs/docs.jsonl   whole router documents (never trained on) for discriminative re-sharding
                             (optional: older shard directories lack it)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dipaco.errors import DipacoError
from dipaco.io import read_json

FORMAT = "dipaco-shards"
FORMAT_VERSION = 2  # 2: routers read the decoded token prefix (routing/prefix.py)


class ShardSet:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DipacoError(f"shard directory {self.root} does not exist; create it with `dipaco shard`")
        self.manifest = read_json(self.root / "manifest.json", "shard manifest")
        if self.manifest.get("format") != FORMAT:
            raise DipacoError(f"{self.root} is not a dipaco shard directory (manifest format "
                              f"{self.manifest.get('format')!r}); create one with `dipaco shard`")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DipacoError(f"{self.root} has shard format version {self.manifest.get('format_version')}, "
                              f"this dipaco reads {FORMAT_VERSION}; re-run `dipaco shard`")
        self.dtype = np.dtype(self.manifest["token_dtype"])
        for path in self.paths:
            for split in ("train", "val"):
                for suffix in ("bin", "idx"):
                    f = self.root / "paths" / path / f"{split}.{suffix}"
                    if not f.is_file():
                        raise DipacoError(f"shard file {f} is missing; the shard directory is incomplete, re-run `dipaco shard`")

    # ------------------------------------------------------------- metadata
    @property
    def grid(self) -> str:
        return self.manifest["grid"]

    @property
    def paths(self) -> list[str]:
        return list(self.manifest["paths"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_token_id(self) -> int:
        return int(self.manifest["eos_token_id"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def train_tokens(self, path: str) -> int:
        return int(self.manifest["paths"][path]["train_tokens"])

    # ---------------------------------------------------------------- data
    def tokens(self, path: str, split: str = "train") -> np.ndarray:
        f = self.root / "paths" / path / f"{split}.bin"
        if f.stat().st_size == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(f, dtype=self.dtype, mode="r")

    def doc_offsets(self, path: str, split: str = "train") -> np.ndarray:
        return np.fromfile(self.root / "paths" / path / f"{split}.idx", dtype=np.int64)

    def heldout(self) -> list[dict]:
        """Whole held-out documents {"text", "label", "path"} (the test set of routed evaluation)."""
        return self._documents("heldout", "re-run `dipaco shard` to write held-out documents")

    def router_docs(self) -> list[dict]:
        """The held-aside router documents (never trained on): discriminative and window routers fit on them."""
        return self._documents("router_docs", "re-shard with data.router_fraction > 0 to keep router documents")

    def _documents(self, folder: str, fix: str) -> list[dict]:
        f = self.root / folder / "docs.jsonl"
        if not f.is_file():
            raise DipacoError(f"{f} is missing; {fix}")
        with open(f, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def tokenizer(self):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(self.root / "tokenizer"))


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from one or more token arrays (nanoGPT style).

    With several arrays, each batch row picks an array with probability proportional to its size.
    The torch generator's state is the data cursor saved in checkpoints.
    """

    def __init__(self, arrays: list[np.ndarray], seq_len: int, batch_size: int, seed: int, names: list[str]):
        usable = [a for a in arrays if len(a) > seq_len + 1]
        if not usable:
            sizes = ", ".join(f"{n}: {len(a)}" for n, a in zip(names, arrays))
            raise DipacoError(f"training data for {'/'.join(names)} has too few tokens ({sizes}) for one sequence of "
                              f"{seq_len + 1}; shard more text, use fewer paths, or lower model.max_seq_len")
        self.arrays, self.seq_len, self.batch_size = usable, seq_len, batch_size
        self.weights = torch.tensor([len(a) - seq_len - 1 for a in usable], dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        sources = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=self.generator)
        rows = []
        for s in sources.tolist():
            array = self.arrays[s]
            start = int(torch.randint(0, len(array) - self.seq_len - 1, (1,), generator=self.generator))
            rows.append(torch.from_numpy(np.asarray(array[start:start + self.seq_len + 1], dtype=np.int64)))
        return torch.stack(rows)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
