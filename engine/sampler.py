"""Turns one row of logits per request into one token, following vLLM's semantics.

Order per row: raw logprobs → min_tokens mask → penalties → greedy argmax, or
temperature → min_p → top_k → top_p → sample. Seeded requests draw only from their own
generator, so their tokens don't depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    # One entry per request, in batch order.
    token_ids: list[int]
    # {token_id: logprob} for the top-n tokens of the raw logits plus the sampled token;
    # None where params.logprobs is None.
    logprobs: list[dict[int, float] | None]


@dataclass(frozen=True)
class Sampler:
    # Masked, with each request's stop_token_ids, until params.min_tokens tokens are out.
    eos_token_ids: tuple[int, ...] = ()

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        # logits: [B, V], row i belongs to requests[i]. Copied to float32 so the caller's
        # tensor is never modified.
        assert logits.dim() == 2 and logits.shape[0] == len(requests), logits.shape
        if all(_plain_greedy(r) for r in requests):
            # The common case: nothing to mask or penalize, so no copy of the logits
            # (argmax of a half-precision row is that of its fp32 cast).
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        params = [r.params for r in requests]
        logits = logits.to(torch.float32, copy=True)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = logits[lp_rows].log_softmax(dim=-1) if lp_rows else None
        token_ids = self._draw(logits, requests)
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=_logprobs(raw_logprobs, lp_rows, token_ids, params),
        )

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The token ids, left on the logits' device: for requests that all sample
        `device_sampled` (their params), so nothing here waits for the GPU."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), logits.shape
        if all(_plain_greedy(r) for r in requests):
            return logits.argmax(dim=-1)
        return self._draw(logits.to(torch.float32, copy=True), requests)

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        # logits: a float32 copy, modified here.
        self._mask_min_tokens(logits, requests)
        _apply_penalties(logits, requests)
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if rows:
            token_ids[rows] = _sample(logits[rows], [requests[i] for i in rows])
        return token_ids

    def _mask_min_tokens(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, req in enumerate(requests):
            p = req.params
            if len(req.output_token_ids) < p.min_tokens:
                # Like vLLM: with ignore_eos, EOS is an ordinary token, so it isn't masked.
                stops = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
                rows += [i] * len(stops)
                cols += stops
        if rows:
            logits[rows, cols] = -torch.inf


def _plain_greedy(req: Request) -> bool:
    p = req.params
    return p.greedy_on_device and len(req.output_token_ids) >= p.min_tokens


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows = [i for i, r in enumerate(requests) if r.params.has_penalty]
    if not rows:
        return
    reqs = [requests[i] for i in rows]
    sub = logits[rows]  # [R, V]
    counts = [_penalty_counts(r, logits.shape[1], logits.device) for r in reqs]
    dev = logits.device
    out_counts = torch.stack([c.output for c in counts])  # [R, V]
    out_seen = out_counts > 0

    if any(r.params.repetition_penalty != 1.0 for r in reqs):
        rep = _column([r.params.repetition_penalty for r in reqs], dev)
        # Repetition covers prompt and output; frequency/presence cover the output only.
        seen = out_seen | torch.stack([_prompt_seen(r, c) for r, c in zip(reqs, counts)])
        factor = torch.where(seen, rep, 1.0)
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    sub -= _column([r.params.frequency_penalty for r in reqs], dev) * out_counts
    sub -= _column([r.params.presence_penalty for r in reqs], dev) * out_seen
    logits[rows] = sub


@dataclass(eq=False)
class PenaltyCounts:
    """A penalized request's token counts on the logits' device, kept on the request and
    brought up to date each step with only the tokens sampled since."""

    output: torch.Tensor  # [V] float32 occurrences in the output
    num_counted: int = 0  # output tokens already in `output`
    prompt_seen: torch.Tensor | None = None  # [V] bool, once a repetition penalty asks


def _prompt_seen(req: Request, c: PenaltyCounts) -> torch.Tensor:
    if c.prompt_seen is None:
        seen = torch.zeros_like(c.output, dtype=torch.bool)
        seen[torch.tensor(req.prompt_token_ids, device=seen.device)] = True
        c.prompt_seen = seen
    return c.prompt_seen


def _penalty_counts(req: Request, vocab: int, device: torch.device) -> PenaltyCounts:
    c = req.penalty_counts
    if c is None or c.output.shape[0] != vocab or c.output.device != device:
        c = req.penalty_counts = PenaltyCounts(torch.zeros(vocab, device=device))
    new = req.output_token_ids[c.num_counted :]
    if new:
        ids = torch.tensor(new, device=device)
        c.output.index_put_((ids,), torch.ones(len(new), device=device), accumulate=True)
        c.num_counted += len(new)
    return c


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    # logits: [R, V] penalized logits of the non-greedy rows (a copy; modified here).
    params = [r.params for r in requests]
    dev = logits.device
    logits /= _column([p.temperature for p in params], dev)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = _column([p.min_p for p in params], dev) * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, -torch.inf)
    # Only these rows pay for a full-vocab sort.
    rows = [i for i, p in enumerate(params) if p.top_k is not None or p.top_p < 1.0]
    if rows:
        logits[rows] = _top_k_top_p(logits[rows], [params[i] for i in rows])
    probs = logits.softmax(dim=-1)

    # Exponential race: argmax(p / E) with E ~ Exp(1) iid is a draw from p, and each
    # row's E comes from that row's generator. Clamping E away from 0 keeps filtered
    # tokens (p = 0) at 0 instead of NaN.
    q = torch.empty_like(probs)
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    if len(seeded) < len(params):
        q.exponential_()
    for i in seeded:
        q[i].exponential_(generator=_generator(requests[i], dev))
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [R, V] -> [R, V] with tokens outside the top-k / top-p set at -inf.
    dev, vocab = logits.device, logits.shape[1]
    # Stable, so ties at the cut keep the lower token id (as argmax would).
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.tensor([p.top_k or vocab for p in params], device=dev).unsqueeze(1)
    sorted_logits.masked_fill_(torch.arange(vocab, device=dev) >= k, -torch.inf)

    top_p = _column([p.top_p for p in params], dev)
    probs = sorted_logits.softmax(dim=-1)
    # Keep token j while the mass before it is < top_p: the smallest set reaching top_p,
    # and never empty since the mass before the first token is exactly 0. Rows with
    # top_p == 1 are skipped so cumsum rounding can't drop their tail.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_((mass_before >= top_p) & (top_p < 1.0), -torch.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _generator(req: Request, device: torch.device) -> torch.Generator:
    # Created on first use and kept on the request, so later steps continue one stream.
    if req.generator is None:
        assert req.params.seed is not None
        req.generator = torch.Generator(device=device).manual_seed(req.params.seed)
    return req.generator


def _logprobs(
    raw: torch.Tensor | None,
    rows: list[int],
    token_ids: torch.Tensor,
    params: list[SamplingParams],
) -> list[dict[int, float] | None]:
    # raw: [len(rows), V] log_softmax of the raw logits of the rows that asked for logprobs.
    out: list[dict[int, float] | None] = [None] * len(params)
    if raw is None:
        return out
    n = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = raw.topk(n, dim=-1)
    sampled = token_ids[rows]
    sampled_vals = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    for j, (i, tok, val) in enumerate(
        zip(rows, sampled.tolist(), sampled_vals.tolist(), strict=True)
    ):
        n_i = params[i].logprobs or 0
        entry = dict(zip(top_ids_l[j][:n_i], top_vals_l[j][:n_i], strict=True))
        entry[tok] = val
        out[i] = entry
    return out
