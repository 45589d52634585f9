"""Text around the engine: prompts through the chat template, stop strings, streaming text."""

from __future__ import annotations

from typing import Any

from eaglewire.tokens import stop_token_ids

__all__ = ["encode_prompt", "stop_token_ids", "StopStrings", "IncrementalDetokenizer", "TextStream"]


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], *, chat: bool) -> list[int]:
    """A plain prompt, or messages / a user prompt through the target's chat template."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


class StopStrings:
    """``should_stop`` for the engine: true once the decoded text contains a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str] | None) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in (stops or []) if s]

    def __call__(self, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def cut(self, text: str) -> str:
        """Text up to (not including) the first stop string."""
        cuts = [text.index(s) for s in self.stops if s in text]
        return text[:min(cuts)] if cuts else text


class IncrementalDetokenizer:
    """Turn a growing token list into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.tokens, self.sent = tokenizer, [], ""

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for more tokens
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class TextStream:
    """Text deltas of a growing token list, cut before the first stop string.

    A tail as long as the longest stop string (minus one) is held back until the end, since a
    stop string may still be arriving; the deltas concatenate to the final text exactly.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.detok, self.stops = IncrementalDetokenizer(tokenizer), StopStrings(tokenizer, stops)
        self.text, self.shown = "", 0
        self.hold = max((len(s) for s in self.stops.stops), default=1) - 1

    def push(self, tokens: list[int]) -> str:
        self.text += self.detok.push(tokens)
        visible = self.stops.cut(self.text)
        upto = max(self.shown, len(visible) - self.hold)
        delta, self.shown = visible[self.shown:upto], upto
        return delta

    def finish(self) -> str:
        delta = self.stops.cut(self.text)[self.shown:]
        self.shown += len(delta)
        return delta
