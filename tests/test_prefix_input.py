"""The routing input without tokenizing whole documents: ``first_ids`` is ``encode(text)[:tokens]``, exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dipaco.routing.prefix import PrefixInput
from dipaco.sharding.tokenizer import EOS, train_tokenizer

_TRAIN = ["the quick brown fox jumps over the lazy dog; " * 20, "def f(x):\n    return x + 1\n" * 30,
          "Ünïcödé ñ 漢字 and emoji 🙂 " * 20, "1234567890 3.14159 " * 30]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(_TRAIN, 400).backend_tokenizer


# pieces that make the cut land in every kind of place: inside a word, a number, a run of spaces or newlines,
# a special token, multi-byte characters, punctuation runs, and very long words
_PIECES = st.sampled_from(["the", " quick", "brown", " ", "  ", "   \n", "\n\n", "\t", "123", "4567", ".", "!?!",
                           "'s", " don't", EOS, "<|", "endoftext", "|>", "漢字", "🙂", "ñ", "x" * 50, " fox" * 5])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_PIECES, max_size=60).map("".join), min_size=1, max_size=8),
       st.integers(1, 40), st.integers(1, 12))
def test_first_ids_is_the_whole_texts_first_tokens(tokenizer, texts, cut, tokens):
    prefix = PrefixInput(tokenizer, tokens)
    prefix.cut_chars = cut  # small: the cut lands inside almost every text
    assert prefix.first_ids(texts) == [ids[:tokens] for ids in prefix.encode(texts)]


def test_other_tokenizers_are_tokenized_whole(tokenizer, monkeypatch):
    from tokenizers import normalizers

    prefix = PrefixInput(tokenizer, 4)
    prefix.cut_chars = 3
    tokenizer.normalizer = normalizers.NFKC()  # the cut argument needs no normalizer: the fast path is off
    try:
        calls = []
        encode = prefix.encode
        monkeypatch.setattr(prefix, "encode", lambda texts: calls.append(list(texts)) or encode(texts))
        texts = ["the quick brown fox", "ﬁne ﬂour"]
        assert prefix.first_ids(texts) == [ids[:4] for ids in encode(texts)] and calls == [texts]
    finally:
        tokenizer.normalizer = None


@pytest.mark.parametrize("text", ["the  " + EOS + " more text", "x\n\n" + EOS + EOS + "y", "don't  stop" + EOS,
                                  "a" * 30 + "   \n  b", "漢字  🙂" + EOS + "  end"])
def test_every_cut_of_crafted_texts(tokenizer, text):
    """Every cut position, including inside a special token after a run of spaces (its segment ends there)."""
    for tokens in (1, 3, 50):
        prefix = PrefixInput(tokenizer, tokens)
        want = prefix.encode([text])[0][:tokens]
        for cut in range(1, len(text) + 1):
            prefix.cut_chars = cut
            assert prefix.first_ids([text]) == [want], (cut, tokens)
