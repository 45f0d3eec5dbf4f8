"""The benchmark's requests: `random` (token-id prompts of a given length), `sharegpt` (the
first human turn of ShareGPT conversations), `prefix-repetition` (N shared prefixes,
each followed by distinct suffixes, to exercise prefix reuse across nodes) and
`multi-turn` (users chatting: each turn's prompt is the user's whole history and a new
question)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Token ids stay this far from both ends of the vocabulary, where special tokens live.
_SPECIAL_MARGIN = 100


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # token ids are sent as they are
    prompt_len: int
    expected_output_len: int


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    # Uniform over [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (vLLM's range).
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    return [rng.randrange(_SPECIAL_MARGIN, vocab_size - _SPECIAL_MARGIN) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if vocab_size <= 2 * _SPECIAL_MARGIN:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small")
    rng = random.Random(seed)
    ins = _lengths(input_len, range_ratio, num, rng)
    outs = _lengths(output_len, range_ratio, num, rng)
    return [SampleRequest(_ids(i, vocab_size, rng), i, o) for i, o in zip(ins, outs)]


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, vocab_size: int, seed: int
                               ) -> list[SampleRequest]:
    """num requests over num_prefixes shared prefixes (round robin), each prefix followed
    by its own random suffix, shuffled."""
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    rng = random.Random(seed)
    prefixes = [_ids(prefix_len, vocab_size, rng) for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        prompt = prefixes[i % num_prefixes] + _ids(suffix_len, vocab_size, rng)
        out.append(SampleRequest(prompt, len(prompt), output_len))
    rng.shuffle(out)
    return out


def multi_turn_requests(users: int, turns: int, question_len: int, output_len: int,
                        vocab_size: int, seed: int) -> list[SampleRequest]:
    """`users` conversations of `turns` turns, token ids: turn t's prompt is the user's
    turn t-1 prompt, a reply of `output_len` tokens and a new question of `question_len`.
    The requests go round by round (every user's turn 1, in a shuffled order, then every
    user's turn 2, ...), so a user's next turn comes a round later, as people chat. The
    reply in the history is drawn here, not the server's answer, so the requests are
    known before the run: the prompt's prefix up to the reply is one the server computed
    before, the reply and the question are new to it."""
    if users < 1 or turns < 1:
        raise ValueError("--multi-turn-users and --multi-turn-turns must be at least 1")
    rng = random.Random(seed)
    histories: list[list[int]] = [[] for _ in range(users)]
    out = []
    for _ in range(turns):
        order = list(range(users))
        rng.shuffle(order)
        for user in order:
            prompt = histories[user] + _ids(question_len, vocab_size, rng)
            out.append(SampleRequest(prompt, len(prompt), output_len))
            histories[user] = prompt + _ids(output_len, vocab_size, rng)
    return out


def sharegpt_requests(path: Path, num: int, count_tokens: Callable[[str], int], seed: int,
                      output_len: int | None = None) -> list[SampleRequest]:
    """Conversations with a human turn then a model turn; vLLM's filter: prompts and
    replies of at least 4 tokens, prompts of at most 1,024 and both of at most 2,048."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: {exc}") from None
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in data if len(c.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(out) == num:
            break
        n_in = count_tokens(prompt)
        n_out = output_len or count_tokens(reply)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
    if len(out) < num:
        raise ValueError(f"{path} has {len(out)} usable conversations; asked for {num}")
    return out
