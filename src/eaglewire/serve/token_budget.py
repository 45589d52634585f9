"""A request's tokens against the model's context: the prompt token ids a request stands for
(through the chat template, or as given), refused before tokenizing when its text cannot fit, and
how many tokens it may generate.
"""

from __future__ import annotations

from tokenizers import decoders

from eaglewire.decode.text import encode_prompt
from eaglewire.serve.api_errors import APIError
from eaglewire.serve.request_bodies import ChatCompletionRequest, CompletionRequest


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for, where that is known without tokenizing; else None.

    For a byte-level BPE tokenizer without a normalizer every token is a fixed byte string, written
    one character per byte, and a character is at least one byte: a token covers at most
    len(longest token) characters of the text. (Tokenizers that normalize, which may delete
    characters, or have an unknown token, which may swallow a whole word, get no such bound.)
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def check_prompt_chars(chars: int, token_chars: int | None, max_context: int, param: str) -> None:
    """Refuse, without tokenizing, a prompt of ``chars`` characters that cannot fit the context.

    The safe direction: the bound must be a floor on the prompt's tokens, so it can only say "too
    long" when tokenizing would say so too. ``chars / token_chars`` is one (no token covers more
    than ``token_chars`` characters). "A token is at least one byte" is a ceiling (tokens <= bytes):
    refusing by it (chars > context) would turn away prompts that fit, e.g. 8,000 '#' are 100 tokens.
    """
    if token_chars is None:
        return
    least = -(-chars // token_chars)
    if least >= max_context:
        raise APIError(400, f"{param} is {chars} characters, so at least {least} tokens (no token of this model is "
                       f"longer than {token_chars} characters), which leaves no room in this model's context of "
                       f"{max_context} tokens; shorten it", param=param, code="context_length_exceeded")


def token_budget(prompt_ids: list[int], requested: int | None, max_context: int, prompt_param: str,
                 tokens_param: str, default: int | None = None) -> int:
    """The number of tokens to generate: the request's, else ``default``, else all the context leaves."""
    if not prompt_ids:
        raise APIError(400, f"{prompt_param} is empty after tokenization; send some text", param=prompt_param)
    room = max_context - len(prompt_ids)
    if room < 1:
        raise APIError(400, f"{prompt_param} is {len(prompt_ids)} tokens, which leaves no room in this model's "
                       f"context of {max_context} tokens; shorten it", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"{tokens_param} {requested} plus the prompt's {len(prompt_ids)} tokens exceeds this "
                       f"model's context of {max_context} tokens; set {tokens_param} to at most {room}",
                       param=tokens_param, code="context_length_exceeded")
    return requested


def chat_prompt_ids(tokenizer, req: ChatCompletionRequest, max_context: int, token_chars: int | None) -> list[int]:
    """The messages through the target's chat template, with the assistant's turn opened (refused
    before tokenizing when the rendered text cannot fit ``max_context``)."""
    messages = [m.as_template_message() for m in req.messages]
    try:
        if token_chars is not None:  # rendering is cheap; tokenizing megabytes is not
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            check_prompt_chars(len(text), token_chars, max_context, "messages")
        return encode_prompt(tokenizer, messages, chat=True)
    except APIError:
        raise
    except Exception as e:  # the template rejects the conversation (e.g. roles out of order)
        raise APIError(400, f"messages do not fit the model's chat template: {e}", param="messages") from e


def completion_prompt_ids(tokenizer, req: CompletionRequest, vocab_size: int, max_context: int,
                          token_chars: int | None) -> list[int]:
    """A text prompt tokenized as is (no template; refused before tokenizing when it cannot fit
    ``max_context``), or token ids checked against the vocabulary."""
    if isinstance(req.prompt, str) or isinstance(req.prompt[0], str):
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        check_prompt_chars(len(text), token_chars, max_context, "prompt")
        return encode_prompt(tokenizer, text, chat=False)
    bad = [t for t in req.prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt holds token ids outside [0, {vocab_size}): {bad[:5]}", param="prompt")
    return list(req.prompt)
