"""How token ids read as text: incremental detokenization and stop-string matching for one
completion, and which tokens of a vocabulary continue a word."""

from __future__ import annotations

from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing list of output token ids, decoded a few at a time.

    Decoding one token alone is wrong for byte-level BPE (a multi-byte
    character spans tokens) and for SentencePiece (a token's leading space
    depends on what precedes it). So each update decodes the short window
    ``ids[prefix_offset:]`` and keeps what it adds beyond
    ``ids[prefix_offset:read_offset]``, the part already emitted; a window
    whose text ends in U+FFFD holds an unfinished character and waits for the
    next token. The text equals ``tokenizer.decode(output_ids)`` without
    decoding the whole list each step.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they completed (maybe empty)."""
        self.token_ids.extend(token_ids)
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset :])
        if len(window) <= len(emitted) or window.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = window[len(emitted) :]
        self.text += delta
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character decodes as U+FFFD)."""
        window = self._decode(self.token_ids[self.prefix_offset :])
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = window[len(emitted) :]
        self.text += delta
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return delta


class TokenIdsOnly:
    """``IncrementalDetokenizer``'s interface for a stage whose tokens are not text
    (a talker's codec ids): it keeps the ids and the text stays empty."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""

    def add_tokens(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        return ""


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last ``num_new_chars``
    characters of ``text``, and where it starts; None when there is none.

    Only the new characters (plus a stop string's length before them) are
    searched, since older text was searched on earlier steps.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx >= 0 and (best is None or idx < best[1]):
            best = (s, idx)
    return best


# What tokenizers put at the start of a token that begins a word: byte-level BPE's space,
# newline and tab (GPT-2, Llama 3, Qwen, SmolLM), SentencePiece's space (Llama 2, Gemma).
_WORD_START = ("\u0120", "\u010a", "\u0109", "\u2581")


def word_piece_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokens that continue a word: their text starts with a letter or digit and
    carries no word-start marker (``"ed"`` in ``" jump" "ed"``). A misspelt or rare word
    is split into such pieces, which is where a copy gets edited. Empty for a vocabulary
    whose merged tokens carry no markers, where nothing tells a piece from a word."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if not any(t and len(t) > 1 and t.startswith(_WORD_START) for t in tokens):
        return frozenset()
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return frozenset(
        i for i, t in enumerate(tokens) if t and t[0].isalnum() and not t.startswith(_WORD_START) and i not in special
    )
