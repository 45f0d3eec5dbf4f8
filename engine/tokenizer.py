"""Tokenizer wrapper, streaming detokenizer and stop-string search."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Tokenizer:
    """A thin wrapper over a transformers (fast) tokenizer.

    `decode` never applies `clean_up_tokenization_spaces`: that rewrite (" ." -> ".") does not
    compose over token windows, and the incremental detokenizer must add up to `decode`.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()):
        self.hf = hf
        own_eos = [] if hf.eos_token_id is None else [int(hf.eos_token_id)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*own_eos, *extra_eos_token_ids]))
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)  # includes added tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # The template already writes the special tokens (bos, <|im_start|>, ...).
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns output tokens into text deltas whose concatenation is `tokenizer.decode(output)`.

    vLLM's offset trick: decode a short window of ids twice, without and with the unread
    tokens, and emit the difference. The window starts at the previously emitted token so a
    SentencePiece leading space or a byte-level BPE merge is decoded in context; a delta ending
    in U+FFFD is an incomplete UTF-8 character and is held until the next token completes it.

    `prompt_token_ids` is not decoded as context: the text is exactly `decode(output_ids)`
    (what the Hugging Face reference produces), so for SentencePiece models the first output
    token's leading space is dropped, as `decode` drops it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Invariant: _window holds the ids from the start of the decode context; the first
        # _read of them are already in _text, the rest are waiting for a complete character.
        self._window: list[int] = []
        self._read = 0
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly finalized text ('' while incomplete)."""
        self._window.append(token_id)
        prefix, full = self._decode_window()
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        return self._emit(full[len(prefix) :])

    def flush(self) -> str:
        """Text still held back (an unfinished character at the end); call once when done."""
        prefix, full = self._decode_window()
        return self._emit(full[len(prefix) :]) if len(full) > len(prefix) else ""

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        return (
            decode(self._window[: self._read], self._skip_special_tokens),
            decode(self._window, self._skip_special_tokens),
        )

    def _emit(self, delta: str) -> str:
        # The just-read tokens become the context for the next ones; older ids are dropped.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._text += delta
        return delta


def find_stop_string(
    text: str, stops: Sequence[str], num_new_chars: int, include_stop: bool = False
) -> int | None:
    """Where to cut `text` for the first stop string that ends in its last `num_new_chars` chars.

    Only occurrences overlapping the new characters are looked for (older text was checked
    when it arrived), which still finds a stop split across two deltas. The occurrence that
    starts first wins (ties: the one that ends first). The cut is before the stop, or after it
    with `include_stop`. None when no stop occurs.
    """
    if num_new_chars <= 0:
        return None
    best: tuple[int, int] | None = None
    for stop in stops:
        if not stop:
            continue
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx >= 0 and (best is None or (idx, idx + len(stop)) < best):
            best = (idx, idx + len(stop))
    if best is None:
        return None
    return best[1] if include_stop else best[0]
