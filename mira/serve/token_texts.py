"""Each token's text in a log-probability answer: what it adds to the text decoded so far, read as
the answer's own text is decoded (mira.runtime.generate.TextStream), so that a sequence's token
texts join into its text and `text_offset` points into it. A token decoded alone does not: a
SentencePiece word loses its leading space, a special token shows though the text skips it, and
each byte of a character split over byte tokens reads as a replacement character (here the token
that completes the character carries it, and the others read as empty)."""

from __future__ import annotations

from collections.abc import Sequence

from mira.runtime.generate import TextStream


class TokenTexts:
    """The texts of one sequence's tokens, given in order."""

    def __init__(self, tokenizer):
        self._pieces: list[str] = []
        self._stream = TextStream(tokenizer, (), self._pieces.append)

    def add(self, token: int, alternatives: Sequence[int] = ()) -> tuple[str, list[str]]:
        """The text `token` adds after the tokens before it, and the text each of `alternatives` would
        add in its place."""
        others = [self._stream.preview(other) for other in alternatives]
        self._pieces.clear()
        self._stream.add([token])
        return "".join(self._pieces), others
