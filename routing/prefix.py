"""The one input every router reads: the first ``tokens`` tokens of a document, decoded (DiPaCo: 32).

A router keeps its own copy of the shard tokenizer, so ``route(texts)`` needs nothing else and every
caller (the shard stage, eval, generate, reshard, the Python API) derives the routing input the same
way: ``decode(encode(text)[:tokens])``. Callers that already hold token ids pass them instead
(``texts_of_ids``), which gives the same string. The window router of every-W routing reads the
``tokens`` = W tokens before a chunk; its caller slices them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from dipaco.errors import DipacoError


class PrefixInput:
    def __init__(self, tokenizer: Tokenizer, tokens: int):
        if tokens < 1:
            raise DipacoError(f"routing.prefix_tokens must be >= 1, got {tokens}")
        self.tokenizer, self.tokens = tokenizer, int(tokens)

    @classmethod
    def of(cls, tokenizer, tokens: int) -> "PrefixInput":
        """From a transformers fast tokenizer or a ``tokenizers.Tokenizer``."""
        return cls(getattr(tokenizer, "backend_tokenizer", tokenizer), tokens)

    def with_tokens(self, tokens: int) -> "PrefixInput":
        return PrefixInput(self.tokenizer, tokens)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of whole texts (no special tokens), as the shard stage tokenizes documents."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def texts_of_ids(self, ids) -> list[str]:
        """The routing text of every token sequence: its first ``tokens`` tokens, decoded."""
        return self.tokenizer.decode_batch([[int(t) for t in x[: self.tokens]] for x in ids], skip_special_tokens=False)

    def texts(self, texts: list[str]) -> list[str]:
        return self.texts_of_ids(self.encode(texts))

    def describe(self) -> dict:
        return {"prefix_tokens": self.tokens, "rule": "decode(encode(text)[:prefix_tokens])"}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "input.json").write_text(json.dumps(self.describe(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "PrefixInput":
        directory = Path(directory)
        if not (directory / "input.json").is_file() or not (directory / "tokenizer.json").is_file():
            raise DipacoError(f"router input {directory} is missing (a router from an older dipaco that routed on "
                              f"characters); re-run `dipaco shard`")
        try:
            spec = json.loads((directory / "input.json").read_text())
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own exception type on a damaged file
            raise DipacoError(f"router input in {directory} is damaged ({exc}); re-run `dipaco shard`") from None
        return cls(tokenizer, int(spec["prefix_tokens"]))
