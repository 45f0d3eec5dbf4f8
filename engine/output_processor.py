"""A sampled token joining its request: its text (incremental detokenization), its stop
checks (a stop token, EOS, a stop string, max_tokens, the context's end) and the output
the engine hands back for it. One per engine, which registers each request as it comes
and `forget`s it as it goes; `finish(req, status)` is the engine's, called when a token
ends its request. This runs for every request at every step, so it calls little."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.engine.outputs import RequestOutput
from tandem.engine.request import FINISHED, PENDING_TOKEN, Request, RequestStatus
from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...],
                 max_model_len: int, finish: Callable[[Request, RequestStatus], None]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.max_model_len, self._finish = max_model_len, finish
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.num_generation_tokens = 0  # since start, pending ones included

    def register(self, req: Request) -> None:
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
            )

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def land(self, requests: list[Request], tokens: list[int]) -> list[RequestOutput]:
        """The tokens of a step launched ahead (one per request, in its place: the
        request's PENDING_TOKEN, or the one before it if a later step sampled too)."""
        outputs = []
        detoks, eos, max_len, plain = self._detok, self.eos_token_ids, self.max_model_len, 0
        for req, token in zip(requests, tokens):
            if req.status in FINISHED:
                continue  # aborted, or stopped, since the launch
            out, p = req.output_token_ids, req.params
            # A later step sampled too (it was launched before this one landed): its
            # pending token stays last.
            twice = len(out) > 1 and out[-2] == PENDING_TOKEN
            n = len(out) - twice  # output tokens once this one lands
            if (p.token_only_stops and token not in p.stop_token_ids
                    and (p.ignore_eos or token not in eos)
                    and (p.max_tokens is None or n < p.max_tokens)
                    and len(req.prompt_token_ids) + n < max_len
                    and req.request_id not in detoks):
                # Most tokens of most steps: `append`'s outcome, with no text and no
                # stop, in the fewest calls.
                out[n - 1] = token
                plain += 1
                outputs.append(RequestOutput(req.request_id, req.prompt_token_ids,
                                             req.output_text, out, None, req.stop_reason,
                                             None, req.num_cached_tokens, "", n))
            elif twice:
                del out[-2:]
                outputs.append(self.append(req, token, None))
                if req.status not in FINISHED:
                    out.append(PENDING_TOKEN)
            else:
                del out[-1:]
                outputs.append(self.append(req, token, None))
        self.num_generation_tokens += plain
        return outputs

    def append(self, req: Request, token: int,
               logprobs: dict[int, float] | None) -> RequestOutput:
        """A sampled token joins its request: its text, its stop checks, its output.
        Runs for every request at every step, so it calls little."""
        req.output_token_ids.append(token)
        self.num_generation_tokens += 1
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        detok = self._detok.get(req.request_id)
        new_text = ""
        if detok is not None:
            new_text = detok.add(token)
            req.output_text += new_text
        status = self._check_stop(req, token, new_text)
        if status is not None:
            if status is RequestStatus.FINISHED_LENGTH:
                self._flush_text(req)  # a character cut off mid-way by the limit
            self._finish(req, status)
        delta = (_stream_delta(req) if len(req.output_text) > req.num_text_streamed
                 else "")
        return RequestOutput.of(req, delta)

    def _flush_text(self, req: Request) -> None:
        detok = self._detok.get(req.request_id)
        if detok is not None:
            req.output_text += detok.flush()

    def _check_stop(self, req: Request, token: int, delta: str) -> RequestStatus | None:
        p = req.params
        num_output = len(req.output_token_ids)
        if num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop and delta:
                cut = find_stop_string(
                    req.output_text, p.stop, len(delta), p.include_stop_str_in_output
                )
                if cut is not None:
                    req.stop_reason = _matched_stop(
                        req.output_text, p.stop, cut, p.include_stop_str_in_output
                    )
                    req.output_text = req.output_text[:cut]
                    return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(req.prompt_token_ids) + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _stream_delta(req: Request) -> str:
    """The text to stream now: what is new since the last delta, less a tail that could
    still turn out to begin a stop string (never streamed, since the stop cuts it)."""
    text, p = req.output_text, req.params
    end = len(text)
    if p.stop and not p.include_stop_str_in_output and not req.is_finished:
        end -= max(map(len, p.stop)) - 1
    if end <= req.num_text_streamed:
        return ""
    delta = text[req.num_text_streamed : end]
    req.num_text_streamed = end
    return delta


def _matched_stop(text: str, stops: Sequence[str], cut: int, included: bool) -> str | None:
    for s in stops:
        if (text[:cut].endswith(s) if included else text.startswith(s, cut)):
            return s
    return None
