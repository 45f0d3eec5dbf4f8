from __future__ import annotations

import copy

import pytest

from tandem.engine.loader import ModelSource, load_tokenizer
from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 🤗🚀 and a family 👨‍👩‍👧‍👦 done.",
    "日本語のテキスト、中文文本和한국어 텍스트。",
    "Accents: café, naïve, Ångström, façade, jalapeño.",
    "multiple   spaces\tand\ttabs\n\n\nnewlines  \n  end  ",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\nprint(f(3))\n",
    " leading space and trailing space ",
    "mixed 🤗日本 é\u00a0non-breaking – dash “quotes”",
]


@pytest.fixture(scope="module")
def tok(smollm2_source: ModelSource) -> Tokenizer:
    tokenizer = load_tokenizer(smollm2_source)
    assert tokenizer is not None
    return tokenizer


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt: "), skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    assert detok.text == "".join(deltas)
    return deltas


def test_tokenizer_basics(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    ids = tok.encode("The capital of France")
    assert tok.decode(ids) == "The capital of France"
    assert tok.decode([1, *ids, 2]) == "The capital of France"
    assert tok.decode([1, *ids, 2], skip_special_tokens=False) == (
        "<|im_start|>The capital of France<|im_end|>"
    )


def test_chat_template_matches_hf(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages)
    ref = tok.hf.apply_chat_template(messages, add_generation_prompt=True)
    ref_ids = ref if isinstance(ref, list) else ref["input_ids"]
    assert ids == ref_ids
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)


def test_chat_template_missing_raises(tok: Tokenizer) -> None:
    hf = copy.deepcopy(tok.hf)
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_deltas_add_up_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_incomplete_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("🤗 hi", add_special_tokens=False)
    assert len(ids) == 4  # the emoji's four bytes span three byte-level tokens
    assert _stream(tok, ids) == ["", "", "🤗", " hi"]


def test_detokenizer_flush_emits_unfinished_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🚀", add_special_tokens=False)[:-1]  # stop mid-emoji
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.add(i) for i in ids]
    assert deltas == ["ok", "", ""]  # " 🚀" is 4 bytes over 3 tokens; the space waits too
    tail = detok.flush()
    assert tail == " \ufffd"
    assert detok.text == "".join(deltas) + tail == tok.decode(ids)
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = [
        *tok.encode("Paris 🇫🇷 is", add_special_tokens=False),
        2,
        *tok.encode("\n日本", add_special_tokens=False),
        1,
    ]
    deltas = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_first_token_is_special(tok: Tokenizer) -> None:
    ids = [1, *tok.encode(" space first", add_special_tokens=False)]
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == " space first"


def test_detokenizer_prefix_of_final_text_at_every_step(tok: Tokenizer) -> None:
    ids = tok.encode("".join(TEXTS), add_special_tokens=False)
    final = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.add(i)
        assert final.startswith(detok.text)
    assert detok.text == final


def test_find_stop_string_in_new_text() -> None:
    assert find_stop_string("Hello world!", ["world"], num_new_chars=12) == 6
    assert find_stop_string("Hello world!", ["world"], 12, include_stop=True) == 11
    assert find_stop_string("Hello world!", ["planet"], 12) is None
    assert find_stop_string("", ["x"], 0) is None
    assert find_stop_string("abc", ["", "c"], 1) == 2  # empty stops are ignored


def test_find_stop_string_split_across_deltas() -> None:
    text = "Hello wor"
    assert find_stop_string(text, ["world"], num_new_chars=len(text)) is None
    text += "ld! more"
    assert find_stop_string(text, ["world"], num_new_chars=8) == 6
    assert find_stop_string(text, ["world"], num_new_chars=8, include_stop=True) == 11
    # The stop must overlap the new characters: older text was searched already.
    assert find_stop_string(text, ["world"], num_new_chars=6) is None  # "! more"
    assert find_stop_string(text, ["world"], num_new_chars=7) == 6  # "d! more"


def test_find_stop_string_earliest_match_wins() -> None:
    text = "a STOP b END c"
    assert find_stop_string(text, ["END", "STOP"], len(text)) == 2
    assert find_stop_string(text, ["END", "STOP"], len(text), include_stop=True) == 6
    # Same start: the shorter stop ends first.
    assert find_stop_string("xx<|end|>", ["<|end|>", "<|"], 9, include_stop=True) == 4
    assert find_stop_string("xx<|end|>", ["<|end|>", "<|"], 9) == 2
    # The first occurrence, not a later one, when the stop repeats in the new text.
    assert find_stop_string("ab\n\nc\n\n", ["\n\n"], 6) == 2


def test_detokenizer_sentencepiece_leading_spaces() -> None:
    # A Metaspace ("▁word") tokenizer: decode() drops the first token's leading space only.
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, the quick brown fox jumps over the lazy dog. café 日本"] * 10
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(
        corpus, vocab_size=80, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>"))
    for text in ["Hello world the lazy  fox", " quick brown", "café 日本 dog"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(_stream(tok, ids)) == tok.decode(ids) == text.lstrip(" ")
