"""Every timeout between the router and the nodes, in one place, so the two sides agree.

The chain of one request (decode-first): the router's Generate call lives at most
`generate_s`; in it the decode node reserves the prompt's blocks under a lease of
`prefill_s + transfer_grace_s` and calls the prefill node with a deadline of `prefill_s`;
the prefill node drops work whose sink has expired, and a prompt the router started early
there whose sink has not come within `early_hold_s`; a prefix pulled from a peer is
computed instead if it has not come within `pull_s`; a reservation made by `Reserve`
alone lives `reserve_ttl_s` (at most `max_ttl_s`) in every state until a Generate takes
it. Aborts are retried until a node answers or the longest lease has lapsed (then the
lease has freed the blocks anyway).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    reserve_ttl_s: float = 30.0  # a Reserve that asks none: its lease
    max_ttl_s: float = 600.0  # a longer lease asked for is cut to this
    prefill_s: float = 300.0  # a Prefill call: queueing, computing and pushing the KV
    transfer_grace_s: float = 10.0  # a decode-first lease outlives its Prefill call by this
    early_hold_s: float = 5.0  # a prefill started early waits this long for its sink
    generate_s: float = 3600.0  # a Generate call, first byte to last
    control_s: float = 5.0  # Health, Stats, Abort
    abort_retry_s: float = 1.0  # between tries of an Abort that got no answer
    engine_stall_s: float = 60.0  # no step ends for this long with work queued: not alive
    pull_s: float = 10.0  # a prefix pull from a peer, reserve to arrival: then computed

    @property
    def lease_s(self) -> float:
        """The longest a reservation may live: an Abort is retried until then."""
        return max(self.max_ttl_s, self.prefill_s + self.transfer_grace_s)


TIMEOUTS = Timeouts()
