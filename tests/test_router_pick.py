"""The router's choice of prefill node prices what each node holds of a prompt: a device
hit is free, a token in a node's host tier costs that node's measured prefill rate over
its measured host-tier rate (in computed tokens), and until both are measured it counts
as a device hit; a token it could pull from a peer, its measured prefill rate over its
measured pull rate (never below a hit of its own). And when a prompt overflows from the
prefill node to its decode node (`--prefill-overflow-ms`)."""

from __future__ import annotations

from tandem.protos import node_pb2 as pb
from tandem.router.pool import Cached, NodeClient, Pool


def _up(node: NodeClient, **stats: float) -> None:
    node.reachable = True
    node.health = pb.HealthReply(role=pb.PREFILL, accepting=True, engine_alive=True,
                                 layout=pb.KVLayout(block_size=16))
    node.stats = pb.StatsReply(role=pb.PREFILL, **stats)


def test_a_host_hit_costs_the_nodes_measured_rates() -> None:
    pool = Pool(["a:1", "b:1"], [])
    a, b = pool.prefill
    # a holds 512 of the prompt's 1,024 tokens in its host tier; b 256 on its device.
    cached = {"a:1": Cached(512, 0), "b:1": Cached(256, 256)}
    _up(a)
    _up(b)
    assert a.host_token_cost() == 0.0  # not measured: as good as a device hit
    assert pool.pick_prefill(1024, cached) is a  # 512 to compute against 768
    # a computes 10,000 tokens/s and copies 1,600 back per second: a host token costs
    # 6.25 computed ones: a costs 512 + 512 x 6.25 = 3,712 against b's 768.
    _up(a, prompt_tokens_timed=10_000, prompt_step_seconds=1.0, host_blocks_timed=100,
        host_load_seconds=1.0)
    assert a.host_token_cost() == 6.25
    assert pool.pick_prefill(1024, cached) is b
    # A host tier 100x faster: a's 512 host tokens cost 32 computed ones.
    _up(a, prompt_tokens_timed=10_000, prompt_step_seconds=1.0, host_blocks_timed=100,
        host_load_seconds=0.01)
    assert a.host_token_cost() == 0.0625
    assert pool.pick_prefill(1024, cached) is a
    assert pool.pick_prefill(1024, {}) in (a, b)  # nothing cached: load alone


def test_a_peer_pull_costs_the_nodes_measured_rates_and_never_beats_a_hit() -> None:
    """b may pull the 1,024 tokens a's device holds: priced by b's measured pull rate
    against its prefill rate, always dearer than a's own hit, and not at all with pulls
    off."""
    layout = pb.KVLayout(block_size=16, num_layers=2, num_kv_heads=1, head_dim=64,
                         dtype="float32")  # 1 KiB a token
    pool = Pool(["a:1", "b:1"], [])
    a, b = pool.prefill
    cached = {"a:1": Cached(1024, 1024)}
    for node in (a, b):
        _up(node)
        node.health.layout.CopyFrom(layout)
    a.stats.queued_prefill_tokens = 600  # a is busy: 600 queued tokens
    assert pool.pick_prefill(2048, cached, pull="never") is a  # 1,624 against b's 2,048
    assert pool.pick_prefill(2048, cached, pull="auto") is b  # not measured: a pull is ~free
    # b computes 10,000 tokens/s and pulls 2 MB/s: a pulled token costs 5 computed ones.
    _up(b, prompt_tokens_timed=10_000, prompt_step_seconds=1.0, kv_bytes_pulled=2_048_000,
        kv_pull_seconds=1.0)
    b.health.layout.CopyFrom(layout)
    assert b.pull_token_cost() == 5.0
    assert pool.pick_prefill(2048, cached, pull="auto") is a
    assert pool.pick_prefill(2048, cached, pull="always") is b
    a.stats.queued_prefill_tokens = 0  # idle: a's own hit beats any pull
    assert pool.pick_prefill(2048, cached, pull="always") is a


def test_a_prompt_overflows_to_the_decode_node_past_the_prefill_nodes_wait() -> None:
    """`--prefill-overflow-ms`: a prompt goes to its decode node where the prompts this
    router sent the prefill node before it, and its own, would be computed later than
    the limit at the node's measured rate, and sooner on the decode node; never before
    the prefill node has a rate, nor with the limit at 0. The queue is a clock: what was
    sent is done once its time has passed, answered or not."""
    from tandem.router.flow import Flow, FlowConfig
    from tandem.router.index import RouterIndex
    from tandem.router.metrics import RouterMetrics

    pool = Pool(["p:1"], ["d:1"])
    (prefill,), (decode,) = pool.prefill, pool.decode
    index = RouterIndex(None, pool, "tiny")
    flow = Flow(pool, FlowConfig(overflow_wait_s=0.2), RouterMetrics(pool, index), index)
    off = Flow(pool, FlowConfig(), RouterMetrics(pool, index), index)
    _up(prefill)
    _up(decode)
    now = 100.0

    def overflows(f: Flow = flow, at: float = now) -> bool:
        return f._overflows(prefill, decode, 1000, {}, 1000, at)

    prefill.take_prompt(10_000, None, now)
    assert prefill.prompts_done_at == 0.0  # nothing counted without a rate
    assert not overflows()  # no rate measured yet
    _up(prefill, prompt_tokens_timed=10_000, prompt_step_seconds=1.0)  # 10,000 tokens/s
    prefill.take_prompt(1000, prefill.prefill_rate(), now)
    assert not overflows()  # 2,000 tokens: 0.2 s, not past the limit
    prefill.take_prompt(1, prefill.prefill_rate(), now)
    assert overflows()  # past it, and the decode node's queue is empty
    assert not overflows(off)
    assert not overflows(at=now + 0.01)  # 100 of the tokens before it computed since
    decode.take_prompt(1001, prefill.prefill_rate(), now)  # as long a wait there
    assert not overflows()
    _up(decode, prompt_tokens_timed=40_000, prompt_step_seconds=1.0)  # 4x as fast there
    assert overflows()
    # Tokens the prefill node holds of the prompt do not wait there.
    assert not flow._overflows(prefill, decode, 1000, {"p:1": Cached(500, 500)}, 1000, now)
