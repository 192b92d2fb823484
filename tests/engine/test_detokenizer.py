"""Incremental detokenization and stop-string search."""

from __future__ import annotations

import random

import pytest

from omnistage.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from omnistage.testing.tiny_checkpoints import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize(
    "text",
    ["hello world! the quick brown fox", "héllo wörld — 日本語 🙂 ok", "<|im_start|>user\nhi<|im_end|> done"],
)
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_text_equals_full_decode(tokenizer, text, skip_special):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
    deltas = [detok.add_tokens([t]) for t in ids]
    detok.flush()
    full = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert "".join(deltas) == detok.text == full
    # A multi-byte character split over byte-level tokens is held back, never
    # emitted half-done.
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_streams_match_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(40)]
        detok = IncrementalDetokenizer(tokenizer)
        i = 0
        while i < len(ids):
            k = rng.randint(1, 3)  # several tokens at once work too
            detok.add_tokens(ids[i : i + k])
            i += k
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_find_stop_string_searches_only_new_text():
    assert find_stop_string("abc STOP def", 12, ["STOP"]) == ("STOP", 4)
    # Straddling the boundary between old and new text.
    assert find_stop_string("abc ST" + "OP", 2, ["STOP"]) == ("STOP", 4)
    # Entirely in old text: already searched on an earlier step.
    assert find_stop_string("STOP and more", 4, ["STOP"]) is None
    # The earliest of several wins.
    assert find_stop_string("xx b a", 6, ["a", "b"]) == ("b", 3)
    assert find_stop_string("nothing here", 5, ["zz"]) is None
