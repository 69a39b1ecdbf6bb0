"""The shard-directory format: its one owner (layout, manifest, fingerprint, version; reader and writer).

``dipaco shard`` (``dipaco.sharding.writer``) and ``dipaco reshard`` (``dipaco.sharding.reshard``) decide
what goes where; this module decides how it lies on disk, and training, eval and the stages read it back
through ``ShardSet``::

    manifest.json            config, versions, counts, input hashes, fingerprint (``ShardWriter.write_manifest``)
    tokenizer/               a Hugging Face tokenizer
    router/                  the frozen router (dipaco.routing.Router)
    paths/<id>/train.bin     flat token ids (manifest's token_dtype), documents separated by EOS
    paths/<id>/train.idx     int64 start offset of every document, plus the end
    paths/<id>/val.bin|idx   the same for the path's validation documents
    heldout/docs.jsonl       whole held-out documents {"text", "label", "path"} for routed evaluation
    router_docs/docs.jsonl   whole router documents (never trained on) for discriminative re-sharding
                             (optional: older shard directories lack it)

The fingerprint (``fingerprint``) names the content a run trains on: the tokenizer hash, the router
directory's hash and the per-path counts. A run records it; every later stage compares it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the sampler imports it: the shard stage's workers write shards without torch (seconds to import)
    import torch

from dipaco.errors import DipacoError
from dipaco.io import read_json, sha256_dir, write_json

FORMAT = "dipaco-shards"
FORMAT_VERSION = 2  # 2: routers read the decoded token prefix (routing/prefix.py)
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
DOC_FOLDERS = ("heldout", "router_docs")  # whole documents kept aside, one JSON object a line in docs.jsonl
# what ShardSet reads from a manifest (besides format and format_version, which write_manifest stamps)
REQUIRED = ("grid", "paths", "token_dtype", "vocab_size", "eos_token_id", "fingerprint")


def token_file(root: str | Path, path: str, split: str, suffix: str) -> Path:
    """``paths/<path>/<split>.bin`` (tokens) or ``.idx`` (document offsets) under a shard directory."""
    return Path(root) / "paths" / path / f"{split}.{suffix}"


def read_docs(root: str | Path, folder: str, fix: str | None = None) -> list[dict]:
    """The documents of ``folder/docs.jsonl``; a missing file is an error naming ``fix``, or no documents
    when ``fix`` is None."""
    f = Path(root) / folder / "docs.jsonl"
    if not f.is_file():
        if fix is None:
            return []
        raise DipacoError(f"{f} is missing; {fix}")
    with open(f, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def fingerprint(tokenizer_sha256: str, router_sha256: str, stats: dict) -> str:
    """The shard directory's fingerprint: sha256 of [tokenizer hash, router hash, per-path counts] as sorted JSON."""
    return hashlib.sha256(json.dumps([tokenizer_sha256, router_sha256, stats], sort_keys=True).encode()).hexdigest()


class ShardSet:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DipacoError(f"shard directory {self.root} does not exist; create it with `dipaco shard`")
        self.manifest = read_json(self.root / MANIFEST, "shard manifest")
        if self.manifest.get("format") != FORMAT:
            raise DipacoError(f"{self.root} is not a dipaco shard directory (manifest format "
                              f"{self.manifest.get('format')!r}); create one with `dipaco shard`")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DipacoError(f"{self.root} has shard format version {self.manifest.get('format_version')}, "
                              f"this dipaco reads {FORMAT_VERSION}; re-run `dipaco shard`")
        self.dtype = np.dtype(self.manifest["token_dtype"])
        for path in self.paths:
            for split in SPLITS:
                for suffix in ("bin", "idx"):
                    f = token_file(self.root, path, split, suffix)
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
    def tokens_of(self, paths: list[str]) -> int:
        """Training tokens of these shard paths together (a trainee's weight in the module averages)."""
        return sum(self.train_tokens(p) for p in paths)

    def tokens(self, path: str, split: str = "train") -> np.ndarray:
        f = token_file(self.root, path, split, "bin")
        if f.stat().st_size == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(f, dtype=self.dtype, mode="r")

    def doc_offsets(self, path: str, split: str = "train") -> np.ndarray:
        return np.fromfile(token_file(self.root, path, split, "idx"), dtype=np.int64)

    def heldout(self) -> list[dict]:
        """Whole held-out documents {"text", "label", "path"} (the test set of routed evaluation)."""
        return read_docs(self.root, "heldout", "re-run `dipaco shard` to write held-out documents")

    def router_docs(self) -> list[dict]:
        """The held-aside router documents (never trained on): discriminative and window routers fit on them."""
        return read_docs(self.root, "router_docs", "re-shard with data.router_fraction > 0 to keep router documents")

    def tokenizer(self):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(self.root / "tokenizer"))


class _PathFiles:
    """Append-only token and offset files of one path split."""

    def __init__(self, root: Path, path: str, split: str):
        self.bin = open(token_file(root, path, split, "bin"), "wb")
        self.idx = open(token_file(root, path, split, "idx"), "wb")
        self.end = 0
        self.idx.write(np.asarray([0], dtype=np.int64).tobytes())

    def append(self, tokens: bytes, n: int) -> None:
        self.bin.write(tokens)
        self.end += n
        self.idx.write(np.asarray([self.end], dtype=np.int64).tobytes())

    def close(self) -> None:
        self.bin.close()
        self.idx.close()


class Sealed(NamedTuple):
    """The content hashes of a finished shard directory, for its manifest."""

    tokenizer_sha256: str
    router_sha256: str
    router: dict  # router/router.json
    fingerprint: str


class ShardWriter:
    """Writes a shard directory under ``root`` (the stage's temporary directory): per-path token files, the
    aside documents, then the manifest. The stage saves ``tokenizer/`` and ``router/`` itself, chooses
    each document's paths, and fills the manifest's report fields. Used by ``shard`` and ``reshard``.

    ``stats`` holds the per-path counts the manifest reports (and the fingerprint covers), ``labels`` the
    label counts of the documents written with a label."""

    def __init__(self, root: Path, paths: list[str], dtype, eos_token_id: int):
        self.root, self.paths, self.dtype, self.eos = Path(root), paths, dtype, eos_token_id
        self.files = {}
        for p in paths:
            (self.root / "paths" / p).mkdir(parents=True)
            for split in SPLITS:
                self.files[p, split] = _PathFiles(self.root, p, split)
        self.docs = {}
        for folder in DOC_FOLDERS:
            (self.root / folder).mkdir()
            self.docs[folder] = open(self.root / folder / "docs.jsonl", "w", encoding="utf-8")
        self.stats = {p: {"train_docs": 0, "train_tokens": 0, "val_docs": 0, "val_tokens": 0} for p in paths}
        self.labels: dict[str, dict[str, int]] = {p: {} for p in paths}

    def write(self, ids, paths: list[str], split: str, label: str | None) -> None:
        """One document's tokens (EOS appended unless it ends with one) to ``split`` of every path in ``paths``."""
        arr = np.asarray(ids, dtype=self.dtype)
        if not len(arr) or arr[-1] != self.eos:
            arr = np.append(arr, np.asarray([self.eos], dtype=self.dtype))
        raw = arr.tobytes()
        for p in paths:
            self.files[p, split].append(raw, len(arr))
            self.stats[p][f"{split}_docs"] += 1
            self.stats[p][f"{split}_tokens"] += len(arr)
            if label is not None:
                self.labels[p][label] = self.labels[p].get(label, 0) + 1

    def append_part(self, part: Path, stats: dict, labels: dict) -> None:
        """Append a part (a directory this class wrote for a slice of the corpus, with its ``stats`` and
        ``labels``): its tokens, its document offsets shifted by what each file already holds, its documents."""
        for p in self.paths:
            for split in SPLITS:
                n = stats[p][f"{split}_docs"]
                if not n:
                    continue
                files = self.files[p, split]
                with open(token_file(part, p, split, "bin"), "rb") as src:
                    shutil.copyfileobj(src, files.bin, 1 << 22)
                ends = np.fromfile(token_file(part, p, split, "idx"), dtype=np.int64)[1:] + files.end
                files.idx.write(ends.tobytes())
                files.end = int(ends[-1])
                for k in (f"{split}_docs", f"{split}_tokens"):
                    self.stats[p][k] += stats[p][k]
            for label, n in labels[p].items():
                self.labels[p][label] = self.labels[p].get(label, 0) + n
        for folder in DOC_FOLDERS:
            with open(part / folder / "docs.jsonl", encoding="utf-8") as src:
                shutil.copyfileobj(src, self.docs[folder], 1 << 22)

    def write_doc(self, folder: str, row: dict) -> None:
        """One whole document (``{"text", "label", "path"}`` and any more fields) to ``folder/docs.jsonl``."""
        self.docs[folder].write(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> None:
        for f in [*self.files.values(), *self.docs.values()]:
            f.close()

    @property
    def tokens(self) -> int:
        return sum(s["train_tokens"] + s["val_tokens"] for s in self.stats.values())

    def documents(self) -> list[int]:
        """Documents (training and validation) of every path, in path order."""
        return [s["train_docs"] + s["val_docs"] for s in self.stats.values()]

    def seal(self, tokenizer_sha256: str) -> Sealed:
        """The router directory's hash and the fingerprint, once ``router/`` is saved and the files are closed."""
        router_sha256 = sha256_dir(self.root / "router")
        router = json.loads((self.root / "router" / "router.json").read_text())
        return Sealed(tokenizer_sha256, router_sha256, router, fingerprint(tokenizer_sha256, router_sha256, self.stats))

    def write_manifest(self, manifest: dict) -> dict:
        """Write ``manifest.json``: ``format`` and ``format_version`` first, then the stage's fields in their
        order, and ``created`` (kept in its place when the stage copied it from a source manifest, else last)."""
        missing = [k for k in REQUIRED if k not in manifest]
        if missing or list(manifest["paths"]) != list(self.paths):
            raise ValueError(f"a shard manifest needs {', '.join(REQUIRED)} and the written paths; missing {missing}")
        out = {"format": FORMAT, "format_version": FORMAT_VERSION}
        out.update((k, v) for k, v in manifest.items() if k not in out)
        out["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_json(self.root / MANIFEST, out)
        return out


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
        import torch

        self.arrays, self.seq_len, self.batch_size = usable, seq_len, batch_size
        self.weights = torch.tensor([len(a) - seq_len - 1 for a in usable], dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        import torch

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
