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
        # characters of a text tokenized before falling back to the whole text: 8 per routing token leaves 32
        # tokens short for 4 of 20,000 shared-corpus documents (a test sets it small to put the cut everywhere)
        self.cut_chars = 8 * self.tokens

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
        return self.texts_of_ids(self.first_ids(texts))

    def first_ids(self, texts: list[str]) -> list[list[int]]:
        """``encode(text)[:tokens]`` of every text, without tokenizing whole documents (the router fit reads
        thousands, and only their first tokens matter). A byte-level BPE tokenizer without a normalizer
        splits text into pieces by a regex that looks at most one character past a piece, then encodes each piece
        alone; so ``text[:cut_chars]`` gives the whole text's tokens for every piece but its last, which the cut may
        have shortened. A special token near the cut would move a segment boundary: such texts, texts whose first
        pieces hold fewer than ``tokens`` tokens, and other tokenizers are tokenized whole."""
        texts = list(texts)
        out: list[list[int] | None] = [None] * len(texts)
        pre = self.tokenizer.pre_tokenizer
        if (self.tokenizer.normalizer is None and type(pre).__name__ == "ByteLevel" and pre.use_regex
                and any(len(t) > self.cut_chars for t in texts)):
            specials = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
            reach = self.cut_chars + max((len(s) for s in specials), default=0)
            cut = self.tokenizer.encode_batch([t[: self.cut_chars] for t in texts], add_special_tokens=False)
            for i, (text, e) in enumerate(zip(texts, cut)):
                if len(text) <= self.cut_chars:
                    out[i] = e.ids[: self.tokens]
                elif not any(s in text[:reach] for s in specials):
                    last = e.word_ids[-1] if e.ids else None
                    whole = [t for t, w in zip(e.ids, e.word_ids) if w != last]
                    out[i] = whole[: self.tokens] if len(whole) >= self.tokens else None
        rest = [i for i, x in enumerate(out) if x is None]
        for i, ids in zip(rest, self.encode([texts[i] for i in rest])):
            out[i] = ids[: self.tokens]
        return out

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
