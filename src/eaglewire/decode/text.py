"""Text around the engine: prompts through the chat template, stop strings, streaming text."""

from __future__ import annotations

from typing import Any

from eaglewire.core.tokens import stop_token_ids

__all__ = ["encode_prompt", "stop_token_ids", "StopStrings", "IncrementalDetokenizer", "TextStream"]


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], *, chat: bool) -> list[int]:
    """A plain prompt, or messages / a user prompt through the target's chat template."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


class IncrementalDetokenizer:
    """Text of a growing token list, decoding only a short window per push.

    The window starts one chunk before the new tokens (``prefix``) so that tokenizers whose
    pieces depend on their left neighbour (SentencePiece's leading space) decode as in the
    whole text; a chunk that ends inside a UTF-8 character (decoded as U+FFFD) waits for more
    tokens. ``flush`` adds what is still waiting, as decoding the whole list would.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.tokens, self.text = tokenizer, [], ""
        self.prefix = self.read = 0  # tokens[prefix:read] decoded to the end of self.text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.tokens += tokens
        window = self._decode(self.tokens[self.prefix:])
        if window.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for more tokens
            return ""
        delta = window[len(self._decode(self.tokens[self.prefix:self.read])):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text still waiting for the rest of a character, replacement characters included."""
        window = self._decode(self.tokens[self.prefix:])
        delta = window[len(self._decode(self.tokens[self.prefix:self.read])):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += delta
        return delta


class StopStrings:
    """``should_stop`` for the engine: true once the decoded text contains a stop string.

    Incremental: each call decodes only the tokens added since the last one and searches only
    the text they could complete a stop string in. It follows one sequence as it grows; a
    call with fewer tokens than the last starts a new sequence.
    """

    def __init__(self, tokenizer: Any, stops: list[str] | None) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in (stops or []) if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self._reset()

    def _reset(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self.found: int | None = None  # where the first stop string starts in self.text

    @property
    def text(self) -> str:
        return self.detok.text

    def feed(self, tokens: list[int]) -> None:
        """Catch up with ``tokens`` (the whole output so far), one token at a time, so the text and
        the stop found do not depend on how the output was chunked."""
        if len(tokens) < len(self.detok.tokens):
            self._reset()
        for tok in tokens[len(self.detok.tokens):]:
            if self.found is not None:
                self.detok.tokens.append(tok)  # stopped: keep count, nothing more to find
                continue
            searched = len(self.detok.text)
            if self.detok.push([tok]) and self.stops:
                self.found = _first_stop(self.detok.text, self.stops, max(0, searched - self.longest + 1))

    def __call__(self, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        self.feed(tokens)
        return self.found is not None

    def cut(self, text: str) -> str:
        """Text up to (not including) the first stop string."""
        cuts = [text.index(s) for s in self.stops if s in text]
        return text[:min(cuts)] if cuts else text


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string in ``text[start:]`` starts, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


class TextStream:
    """Text deltas of a growing token list, cut before the first stop string.

    A tail as long as the longest stop string (minus one) is held back until the end, since a
    stop string may still be arriving; the deltas concatenate to the final text exactly.
    Hand ``stops`` to the engine as ``should_stop``: both read the same incremental text.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.stops = StopStrings(tokenizer, stops)
        self.tokens: list[int] = []
        self.shown = 0
        self.hold = max(self.stops.longest - 1, 0)

    def _visible(self) -> int:
        """How much of the text may ever be shown: all of it, or up to the stop string."""
        return len(self.stops.text) if self.stops.found is None else self.stops.found

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        self.stops.feed(self.tokens)
        end = self._visible()
        upto = max(self.shown, end - (self.hold if self.stops.found is None else 0))
        delta, self.shown = self.stops.text[self.shown:upto], upto
        return delta

    def finish(self) -> str:
        if self.stops.found is None:
            self.stops.detok.flush()
        text = self.stops.cut(self.stops.text)
        delta = text[self.shown:]
        self.shown += len(delta)
        return delta
