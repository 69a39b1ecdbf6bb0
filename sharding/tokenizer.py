"""The tokenizer: a byte-level BPE trained on the corpus (tokenizers), saved as a transformers tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # imported where used: a pass-2 worker encodes with the Rust tokenizer alone
    from transformers import PreTrainedTokenizerFast

from dipaco.errors import DipacoError

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes without unknown tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=None, model_max_length=1 << 30, clean_up_tokenization_spaces=False)


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise DipacoError(f"{directory} holds no tokenizer.json; pass a Hugging Face tokenizer directory to --tokenizer")
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(directory))
    if tok.eos_token_id is None:
        raise DipacoError(f"tokenizer in {directory} has no EOS token; documents need a separator, add one and save it again")
    tok.model_max_length = 1 << 30
    return tok


def load_backend_tokenizer(directory: str | Path) -> Tokenizer:
    """The Rust tokenizer of a directory ``load_tokenizer`` accepted before (its tokenizer.json): the same ids,
    without importing transformers (a pass-2 worker only encodes)."""
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))


def encode(tok: PreTrainedTokenizerFast | Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens (batched in Rust, on all cores)."""
    return [e.ids for e in getattr(tok, "backend_tokenizer", tok).encode_batch(texts, add_special_tokens=False)]


def tokenizer_sha256(directory: str | Path) -> str:
    """Content hash of a saved tokenizer: its tokenizer.json (vocabulary, merges, pre-tokenizer, special
    tokens) as canonical JSON. Loading and saving a tokenizer again (``--tokenizer DIR``) keeps the hash;
    tokenizer_config.json gains bookkeeping fields on a round trip, so it is left out."""
    data = json.loads((Path(directory) / "tokenizer.json").read_text(encoding="utf-8"))
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
