"""Continuous batching: running requests first, then admit waiting ones under a
token budget (chunked prefill), preempting the newest by recompute when blocks run out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import FINISHED, Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request]
    # Tokens each request computes this step, starting at its num_computed_tokens.
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def without_finished(self) -> ScheduledBatch:
        keep = [i for i, r in enumerate(self.requests) if not r.is_finished]
        return ScheduledBatch([self.requests[i] for i in keep],
                              [self.num_new_tokens[i] for i in keep])

    def samples(self, i: int) -> bool:
        """A request samples once this step brings its KV up to its last token."""
        req = self.requests[i]
        return req.num_computed_tokens + self.num_new_tokens[i] == req.num_tokens

    def sampling_requests(self) -> list[Request]:
        return [r for r, n in zip(self.requests, self.num_new_tokens)
                if r.num_computed_tokens + n
                == len(r.prompt_token_ids) + len(r.output_token_ids)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        # Holding their prompt's blocks (a decode node reserved them), waiting only for a
        # place among the running (max_num_seqs): they go in first.
        self.ready: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request that already holds the blocks of its prompt (a decode node reserved
        them) joins the running batch as soon as fewer than max_num_seqs run; its
        uncomputed tokens are computed from then on."""
        self.ready.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.ready or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        while self.ready and len(self.running) < self.config.max_num_seqs:
            req = self.ready.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        preemptions_before = self.num_preemptions
        kv, running, max_len = self.kv, RequestStatus.RUNNING, self.config.max_model_len
        for req in list(self.running):  # inline: every running request, every step
            if budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            max_tokens = req.params.max_tokens
            if ((max_tokens is not None and len(req.output_token_ids) >= max_tokens)
                    or num_tokens >= max_len):
                continue  # its last token is still pending on the device (async scheduling)
            if kv.window:
                kv.release_behind(req)
            num_new = min(num_tokens - req.num_computed_tokens, budget)
            if (req.num_computed_tokens + num_new > len(req.block_ids) * kv.block_size
                    and not self._make_room(req, num_new, scheduled)):
                continue  # most steps of a decode: its last block has room
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            scheduled.add(req.request_id)
            budget -= num_new
        # Admitting while preempting would only thrash: the victims go first next step.
        if self.num_preemptions == preemptions_before:
            self._admit(batch, budget)
        return batch

    def _make_room(self, req: Request, num_new: int, scheduled: set[str]) -> bool:
        """Blocks for `req`'s next `num_new` tokens, preempting the newest running
        requests not yet in this step's batch while blocks run out (`req` itself too, if
        it is the newest). False if it got none."""
        while not self.kv.allocate(req, num_new):
            victim = self.running[-1]
            if victim.request_id in scheduled:
                return False  # nothing left to preempt but requests already in the batch
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.find_cached_blocks(req, promote=True)
            cached = len(hits) * self.kv.block_size
            num_new = min(req.num_uncomputed_tokens - cached, budget)
            if not self.kv.allocate(req, num_new, hits):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def postprocess(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and cache newly full blocks (before tokens append)."""
        caching = self.kv.enable_prefix_caching
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.status in FINISHED:
                continue  # ended (async scheduling) before this step was postprocessed
            req.num_computed_tokens += n
            if caching:
                self.kv.cache_computed_blocks(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.ready:
            self.ready.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
