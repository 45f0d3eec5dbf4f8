"""A request owns its state; counts are derived, never stored twice."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.engine.sampling_params import SamplingParams


# An output token sampled on the device whose value the host has not read yet: with
# async scheduling, a step is launched before the previous step's tokens are read, and
# each request it samples for holds this in place of its newest token until they are.
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


# For the loops over every request of a step: `status in FINISHED` costs no call.
FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # Folded into every block hash (cache salt / adapter id); None for the common case.
    cache_salt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    # Top-n logprobs per generated token, when `params.logprobs` is set.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the cache (computed or reused from the prefix cache).
    num_computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0  # of those, copied back from the host tier
    num_peer_cached_tokens: int = 0  # of those, pulled from a peer just before (node/pull.py)
    # Physical KV block ids, in order; block i holds tokens [i*bs, (i+1)*bs).
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks given back, every layer having slid past them (a sliding window).
    num_released_blocks: int = 0
    # Hash chain of the request's full blocks, extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # Per-request RNG for seeded sampling; the sampler creates it on the logits' device.
    generator: torch.Generator | None = None
    # Prompt and output token counts for penalties, updated incrementally by the sampler.
    penalty_counts: Any = None
    output_text: str = ""
    num_text_streamed: int = 0  # leading characters of output_text sent as deltas
    stop_reason: int | str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until the whole prompt (and, after preemption, the output so far) is in KV."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status in FINISHED else None
