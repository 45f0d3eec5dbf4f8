"""The host tier (engine/host_tier.py): blocks evicted from a small device cache are kept
in host memory and copied back when a prompt meets them again, never computed twice;
outputs stay those of an engine that caches nothing."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.block_hash import BlockHash
from tandem.engine.host_tier import Evicted, HostTier

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_prompts_that_overflow_the_device_cache_come_back_from_the_host(device: str) -> None:
    prompts = _prompts(6, 50)  # 3 full blocks each; 10 device blocks hold two requests
    kwargs = {"load_format": "dummy", "device": device, "dtype": "float32"}
    want = [o.token_ids for o in LLM("tiny", num_kv_blocks=64, enable_prefix_caching=False,
                                     **kwargs).generate(prompts, GREEDY)]
    llm = LLM("tiny", num_kv_blocks=10, host_kv_bytes=1 << 20, max_num_seqs=2, **kwargs)
    engine, tier = llm.engine, llm.engine.host_tier
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert engine.num_prompt_tokens_cached_host == 0 and tier.blocks_saved > 0
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    # Every full prompt block came back from the host: none computed again, none from
    # the device (each was evicted by the later prompts before its turn came).
    assert engine.num_prompt_tokens_cached_host == engine.num_prompt_tokens_cached == 6 * 48
    assert tier.blocks_loaded == 6 * 3
    # 18 distinct full blocks, each copied out once: one loaded back and evicted again
    # is in the tier already.
    assert tier.blocks_saved == 6 * 3
    if device == "cuda":
        torch.cuda.synchronize()
    tier.settle()  # every load timed, on CUDA by its events
    assert tier.timed_blocks == tier.blocks_loaded and tier.timed_seconds > 0


def test_without_a_host_tier_the_same_prompts_are_computed_again() -> None:
    prompts = _prompts(6, 50)
    llm = LLM("tiny", load_format="dummy", num_kv_blocks=10, max_num_seqs=2)
    llm.generate(prompts, GREEDY)
    llm.generate(prompts, GREEDY)
    assert llm.engine.host_tier is None and llm.engine.num_prompt_tokens_cached == 0


def _caches(num_blocks: int = 4, one_tensor: bool = False) -> list[torch.Tensor]:
    # 3 layers, blocks of 2 tokens; one_tensor: the layers are views of one (the runner's)
    if one_tensor:
        return list(torch.randn(3, 2, num_blocks, 2, 1, 3).unbind(0))
    return [torch.randn(2, num_blocks, 2, 1, 3) for _ in range(3)]


@pytest.mark.parametrize("one_tensor", [False, True])
def test_the_tier_evicts_its_least_recently_used_block_and_rechecks_tokens(
        one_tensor: bool) -> None:
    caches = _caches(one_tensor=one_tensor)
    tier = HostTier(2, caches)
    a, b, c = (BlockHash(i.to_bytes(16, "little")) for i in (1, 2, 3))
    tier.save([Evicted(0, a, (1, 2)), Evicted(1, b, (3, 4))])
    assert tier.lookup(a, (1, 2)) is not None  # a is now the most recently used
    assert tier.lookup(a, (1, 9)) is None  # same hash, other tokens: a miss
    tier.save([Evicted(2, c, (5, 6))])  # full: b, the least recently used, goes
    assert tier.lookup(b, (3, 4)) is None and tier.usage == 1.0
    slot = tier.lookup(c, (5, 6))
    before = [x[:, 3].clone() for x in caches]
    tier.load([slot], [3])  # block 2's KV, as saved, into block 3
    for layer, old in zip(caches, before):
        assert torch.equal(layer[:, 3], layer[:, 2]) and not torch.equal(layer[:, 3], old)
    assert tier.blocks_saved == 3 and tier.blocks_loaded == 1
    assert (tier._layers is not None) is one_tensor


def test_a_host_tier_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(0, _caches())


def test_tandem_up_serves_prompts_again_from_the_host_tier() -> None:
    """Real processes, `tandem up` (1P1D) with device caches too small for the prompts:
    sent again, they come back from a host tier, counted under tier="host", and the
    tokens are still the offline engine's."""
    import json
    import time
    import urllib.request

    from serving_helpers import metric_samples, tandem_up

    prompts = _prompts(6, 50, seed=1)
    offline = LLM("tiny", load_format="dummy")
    want = [o.token_ids for o in offline.generate(prompts, GREEDY)]
    flags = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
             "--num-kv-blocks", "10", "--max-num-seqs", "2", "--kv-host-gib", "0.001"]
    with tandem_up(flags) as (url, _, _):
        def complete(prompt: list[int]) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            req = urllib.request.Request(f"{url}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["choices"][0]["token_ids"]

        for _ in range(2):  # the second round finds every prompt evicted to the host
            assert [complete(p) for p in prompts] == want
        # The router polls each node's stats every second, each node on its own: wait
        # until both nodes' figures of the second round are in.
        deadline = time.monotonic() + 15
        while True:
            samples = metric_samples(url)
            host = sum(v for name, labels, v in samples
                       if name == "tandem:prefix_cache_hits_total" and labels["tier"] == "host")
            usage = [v for name, _, v in samples if name == "tandem:kv_host_usage"]
            steps = {kind: sum(v for name, labels, v in samples
                               if name == "tandem:engine_steps_total" and labels["kind"] == kind)
                     for kind in ("eager", "decode_graph", "prefill_graph")}
            if (host >= 6 * 48 and steps["eager"] >= 12 * 2) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert host >= 6 * 48  # every full prompt block of the second round, on some node
    assert usage and max(usage) > 0
    # On the CPU every step runs eagerly: 12 prompts, each a prefill and decodes.
    assert steps["eager"] >= 12 * 2 and steps["decode_graph"] == steps["prefill_graph"] == 0


def test_promotion_takes_only_blocks_that_are_free_besides_the_prompts_own_hits() -> None:
    """A prompt whose first block is a free device hit and whose second is in the host
    tier, with no other device block free: the second cannot be brought back (the one
    free block is the prompt's own hit), and the hit is not taken from under it."""
    from tandem.engine.block_hash import root_hash
    from tandem.engine.block_pool import BlockPool
    from tandem.engine.kv_cache_manager import KVCacheManager
    from tandem.engine.request import Request

    params = SamplingParams(max_tokens=1)
    kv = KVCacheManager(BlockPool(2), 2, root_hash("t", "float32", 2), True)
    tier = HostTier(4, _caches(num_blocks=2))
    kv.attach_host_tier(tier)
    prompt = Request("p", [1, 2, 3, 4, 5], params)
    kv.find_cached_blocks(prompt)  # its block hashes: [1 2], [3 4]
    warm = Request("w", [1, 2, 7], params)
    assert kv.allocate(warm, 3)
    warm.num_computed_tokens = 3
    kv.cache_computed_blocks(warm)  # [1 2] cached on the device
    kv.free(warm)
    held = Request("h", [8], params)
    assert kv.allocate(held, 1)  # takes the other block: only the [1 2] hit is free
    tier.save([Evicted(1, prompt.block_hashes[1], (3, 4))])
    hits = kv.find_cached_blocks(prompt, promote=True)
    assert [b.block_hash for b in hits] == prompt.block_hashes[:1] and tier.blocks_loaded == 0
    kv.free(held)  # now a block is free: [3 4] comes back into it
    hits = kv.find_cached_blocks(prompt, promote=True)
    assert [b.block_hash for b in hits] == prompt.block_hashes[:2] and tier.blocks_loaded == 1


def test_the_index_hears_of_a_block_leaving_the_node_only_when_the_tier_drops_it() -> None:
    """Block events: a cached block that leaves the device for the host tier is still
    the node's (no "evicted"); one the tier drops to make room, and the device no longer
    holds, is."""
    from tandem.engine.block_hash import root_hash
    from tandem.engine.block_pool import BlockPool
    from tandem.engine.kv_cache_manager import KVCacheManager
    from tandem.engine.request import Request

    events = []
    pool = BlockPool(2, events.append)
    kv = KVCacheManager(pool, 2, root_hash("t", "float32", 2), True)
    kv.attach_host_tier(HostTier(1, _caches(num_blocks=2)))

    def run(rid: str, prompt: list[int]) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=1))
        assert kv.allocate(req, len(prompt))
        req.num_computed_tokens = len(prompt)
        kv.cache_computed_blocks(req)
        kv.free(req)
        return req

    a = run("a", [1, 2, 3])  # [1 2] stored
    b = run("b", [5, 6, 7])  # reuses [1 2]'s block: to the host tier, not evicted
    assert [(e.kind, e.block_hashes) for e in events] == [
        ("stored", (a.block_hashes[0],)), ("offloaded", (a.block_hashes[0],)),
        ("stored", (b.block_hashes[0],))]
    run("c", [8, 9, 4])  # [5 6] to the host; the one-slot tier drops [1 2]
    assert [(e.kind, e.block_hashes) for e in events[3:]] == [
        ("offloaded", (b.block_hashes[0],)), ("evicted", (a.block_hashes[0],)),
        ("stored", (events[-1].block_hashes[0],))]


def test_a_nodes_block_events_carry_the_tier_in_order() -> None:
    """A real node's `BlockEvents` stream (gRPC): blocks evicted from a small device cache
    arrive as `offloaded` (the host tier holds them), a batch never mixes kinds, and a
    new follower's snapshot puts each hash in the tier the engine holds it in. Its Stats
    report the measured prefill and host-tier rates."""
    import threading

    import grpc

    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.node import convert
    from tandem.node.grpc_server import serve
    from tandem.node.server import NodeService
    from tandem.protos import node_pb2 as pb
    from tandem.protos import node_pb2_grpc as pb_grpc

    engine = LLMEngine(EngineConfig(model="tiny", load_format="dummy", skip_tokenizer_init=True,
                                    cache=CacheConfig(num_blocks=10, host_kv_bytes=1 << 20)))
    service = NodeService(engine, "decode")
    server, port = serve(service)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.NodeStub(channel)
    batches: list[pb.BlockEventBatch] = []
    follow = stub.BlockEvents(pb.BlockEventsRequest())
    def read() -> None:
        try:
            batches.extend(follow)
        except grpc.RpcError:  # cancelled at the end
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for i, prompt in enumerate(_prompts(6, 50, seed=3) * 2):  # again: host hits
            request = pb.Request(request_id=f"r{i}", prompt_token_ids=prompt,
                                 sampling=convert.sampling_to_pb(GREEDY))
            list(stub.Generate(pb.GenerateRequest(request=request), timeout=60))
        stats = stub.Stats(pb.StatsRequest(), timeout=10)  # the rates routing prices by
        assert stats.prompt_tokens_timed == stats.prompt_tokens_computed > 0
        assert stats.prompt_step_seconds > 0 and stats.host_load_seconds > 0
        assert stats.host_blocks_timed == engine.host_tier.blocks_loaded > 0
        device, host = engine.cached_block_hashes()
        assert host  # the device holds 10 blocks: most of the 18 prompt blocks left it
        snapshot = next(iter(stub.BlockEvents(pb.BlockEventsRequest(), timeout=10)))
        assert snapshot.snapshot and (list(snapshot.stored), list(snapshot.offloaded)) == (
            device, host)
    finally:
        follow.cancel()
        reader.join(timeout=10)
        channel.close()
        server.stop(grace=1).wait()
        service.close()
    kinds = [[k for k in ("stored", "offloaded", "evicted") if getattr(b, k)]
             for b in batches[1:]]
    assert all(len(k) == 1 for k in kinds), kinds
    assert ["offloaded"] in kinds
    # Replayed in order, the events leave each hash in the tier the engine holds it in.
    tier: dict[bytes, str] = {h: "device" for h in batches[0].stored}
    for b in batches[1:]:
        for h in b.stored:
            tier[h] = "device"
        for h in b.offloaded:
            tier[h] = "host"
        for h in b.evicted:
            tier.pop(h, None)
    assert tier == {**{h: "host" for h in host}, **{h: "device" for h in device}}
