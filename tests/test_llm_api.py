"""The offline API on the real SmolLM2 weights: bad input, stop strings, seeds, logprobs."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.request import RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", max_model_len=512)


def test_chat_answers_the_capital_of_france(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ended its turn with <|im_end|>
    assert out.token_ids[-1] in llm.engine.eos_token_ids


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(max_tokens=-3), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(make, field: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=field):
        make()


def test_bad_prompts_raise_and_leave_the_batch_intact(llm: LLM) -> None:
    too_long = "word " * 600  # over the 512-token context
    for bad, message in [("", "empty"), ([], "empty"), (too_long, "context length"),
                         ([1, 2, 10**9], "vocabulary")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["Hello there", bad], GREEDY)
    # Nothing was admitted: the engine is empty and every block is free.
    assert not llm.engine.has_unfinished
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_bad_request_does_not_harm_requests_already_running(llm: LLM) -> None:
    engine = llm.engine
    expected = llm.generate(["The capital of Italy is"], GREEDY)[0].token_ids
    engine.add_request("good", "The capital of Italy is", GREEDY)
    engine.step()  # the good request is running
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("bad", "word " * 600, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", GREEDY)
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == ["good"] and done["good"].token_ids == expected


@pytest.mark.parametrize("model", ["no-such-model", "/nonexistent/model.gguf", "/tmp"])
def test_unknown_model_or_missing_file(model: str) -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(model)


def test_stop_string_split_across_tokens_cuts_exactly(llm: LLM) -> None:
    prompt = "Count from one to twenty in words: one, two, three,"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))[0]
    tok = llm.get_tokenizer()
    # Find a stop string that starts inside one token and ends inside the next.
    pieces = [tok.decode([t]) for t in free.token_ids]
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    stop = free.text[starts[i] + 1 : starts[i + 1] + 1]  # last chars of token i + first of i+1
    cut = free.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0]
    assert out.text == free.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                       include_stop_str_in_output=True),
    )[0]
    assert kept.text == free.text[: cut + len(stop)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    free = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[4]
    out = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]),
    )[0]
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234)
    alone = llm.generate("Tell me a story", params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(["Hi", "Tell me a story", "Why?"], [others, params, others])
    assert batch[1].token_ids == alone
    other_seed = llm.generate("Tell me a story", SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=20, seed=99))[0].token_ids
    assert other_seed != alone


def test_logprobs_include_the_sampled_token(llm: LLM) -> None:
    out = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) >= 3
        assert lp[token] == max(lp.values())  # greedy picks the most likely token
        assert all(v <= 0.0 for v in lp.values())


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("to-abort", "Write a long essay about the sea.", GREEDY)
    engine.step()
    assert engine.block_pool.num_free_blocks < engine.block_pool.num_blocks
    out = engine.abort("to-abort")
    assert out is not None and out.finish_reason == RequestStatus.FINISHED_ABORTED.value
    assert not engine.has_unfinished
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
