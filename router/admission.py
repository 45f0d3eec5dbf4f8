"""The router's queue: a request that finds every decode node at its limit waits here,
first come first served, until a node has room or its deadline passes.

A decode node has room while this router's requests on it (`in_flight`) are fewer than
the node's `max_requests` (its Health says), and it has not just refused one
(RESOURCE_EXHAUSTED: another router filled it; `busy` keeps it out for `BUSY_S`). A node
handed out is charged at once (`in_flight`), so two waiters never take one slot; the
caller gives it back with `release`, which hands it to the next waiter.

Refusals, both OpenAI error JSON: past `max_queued` waiting, 429 with Retry-After;
a deadline passed while queued, 503 with code `queue_timeout`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from tandem.router.pool import NodeClient, Pool
from tandem.router.protocol import APIError

BUSY_S = 0.2  # a node that refused a request for want of room is passed over this long
TICK_S = 0.2  # waiters look again this often (a node came up, a busy spell ended)
DEFAULT_NODE_MAX_REQUESTS = 8192  # a node whose Health names no limit


@dataclass(eq=False)
class _Waiter:
    exclude: set[NodeClient]
    handed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                   .create_future())


class DecodeQueue:
    def __init__(self, pool: Pool, max_queued: int, timeout_s: float) -> None:
        self.pool, self.max_queued, self.timeout_s = pool, max_queued, timeout_s
        self._waiters: deque[_Waiter] = deque()
        self._ticker: asyncio.Task | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def take(self, exclude: set[NodeClient], deadline: float) -> NodeClient | None:
        """A decode node with room, charged one request; None when no decode node is
        up at all (nothing to wait for). Waits, in arrival order, until `deadline`
        (time.monotonic()); APIError 429 past `max_queued`, 503 at the deadline."""
        if not self._waiters:
            node = self._pick(exclude)
            if node is not None or not self._any_up(exclude):
                return self._charge(node)
        if len(self._waiters) >= self.max_queued:
            raise APIError(f"{self.max_queued} requests are queued already; retry later",
                           status=429, kind="rate_limit_error", code="too_many_requests")
        waiter = _Waiter(exclude)
        self._waiters.append(waiter)
        self._tick()
        node = None
        try:
            node = await asyncio.wait_for(asyncio.shield(waiter.handed),
                                          max(0.0, deadline - time.monotonic()))
            return node
        except TimeoutError:
            raise APIError(f"the request waited {self.timeout_s:g}s in the queue for a "
                           f"decode node with room", status=503, kind="service_unavailable",
                           code="queue_timeout") from None
        finally:
            if node is None:
                self._drop(waiter)

    def release(self, node: NodeClient) -> None:
        """One request of this router on `node` ended."""
        node.in_flight -= 1
        self.wake()

    def busy(self, node: NodeClient) -> None:
        """`node` refused a request for want of room."""
        node.busy_until = time.monotonic() + BUSY_S

    def wake(self) -> None:
        """Hand nodes with room to the waiters, in order; a waiter with no node up at
        all gets None."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.handed.done():
                self._waiters.popleft()
                continue
            node = self._pick(waiter.exclude)
            if node is None and self._any_up(waiter.exclude):
                return
            self._waiters.popleft()
            waiter.handed.set_result(self._charge(node))

    def _drop(self, waiter: _Waiter) -> None:
        """A waiter that did not take a node (timed out, cancelled): one handed to it
        just then goes back."""
        if not waiter.handed.done():
            waiter.handed.cancel()
        elif not waiter.handed.cancelled() and waiter.handed.result() is not None:
            self.release(waiter.handed.result())

    def _charge(self, node: NodeClient | None) -> NodeClient | None:
        if node is not None:
            node.in_flight += 1
        return node

    def _pick(self, exclude: set[NodeClient]) -> NodeClient | None:
        full = {n for n in self.pool.decode if not _has_room(n)}
        return self.pool.pick_decode(exclude | full)

    def _any_up(self, exclude: set[NodeClient]) -> bool:
        return any(n.healthy for n in self.pool.decode if n not in exclude)

    def _tick(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._look_again())

    async def _look_again(self) -> None:
        while self._waiters:
            await asyncio.sleep(TICK_S)
            self.wake()


def _has_room(node: NodeClient) -> bool:
    h = node.health
    limit = h.max_requests if h is not None and h.max_requests else DEFAULT_NODE_MAX_REQUESTS
    return node.in_flight < limit and time.monotonic() >= node.busy_until
