"""Prefix pulls between peers (DESIGN.md, KV tiers and reuse): a node about to compute a
prompt whose leading blocks another node holds in its prefix cache takes them from there
instead of computing them.

The puller (`Puller.pull`, on its asyncio loop, before the prompt is added):

    reserve blocks for the prefix blocks it lacks, under a sink on its own transfer
        agent (as a decode node reserves a prompt's: `DecodeRole.reserve`)
    ask the holder to push them there (`Pull`, a call authenticated like any other)
    once they are in, keep them in its own prefix cache and let the reservation go: the
        prompt, added next, finds them there like any cached prefix

A pull that fails (the holder is gone or slow, its blocks were evicted, the secret is
wrong, the sink expired) gives the blocks back, and the prompt is computed whole.

The holder (`serve_pull`, either role, draining too): finds the prefix in its device
cache (blocks its host tier holds are copied back into device blocks first), holds those
blocks (a reference: nothing evicts or rewrites them) while it pushes
them into the puller's sink with `KVPush`, every layer computed, as a prefill push does,
and hands the reference back once every read of them is done. The push gives up at the
sink's expiry: that is the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from tandem.decode_node.role import DecodeRole
from tandem.engine.block_pool import Block
from tandem.engine.llm_engine import LLMEngine, bind_thread
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import Connector, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import push
from tandem.kvtransfer.staging import KVRows
from tandem.node import auth, convert
from tandem.node.loop import EngineLoop
from tandem.protos import node_pb2 as pb

log = logging.getLogger(__name__)

PULL_SUFFIX = "/pull"  # the reservation's request id: the prompt's, and this
MIN_PULL_BLOCKS = 2  # fewer blocks than this are not worth a round trip
# A holder pushes at most this many pulls at once, each on a thread of its own; the rest
# wait their turn (within their sinks' expiry), as staged prefill pushes do.
MAX_PULL_PUSHES = 4
_pushes = ThreadPoolExecutor(MAX_PULL_PUSHES, thread_name_prefix="kv-pull")


class StalePull(ValueError):
    """The holder no longer holds the blocks asked for."""


async def serve_pull(loop: EngineLoop, connector: Connector, rows: KVRows, layout: KVLayout,
                     req: Request, sink: SinkInfo, first_block: int,
                     secret: bytes | None) -> int:
    """Push blocks first_block.. of `req`'s prompt (whole blocks, from this node's prefix
    cache) into `sink`; the bytes pushed. StalePull if they are not all cached here,
    TransferError if the push fails."""
    stop = first_block + len(sink.block_ids)

    def hold(engine: LLMEngine) -> list[Block]:
        hits = engine.scheduler.kv.find_cached_blocks(req, promote=True, whole=True)
        if len(hits) < stop:
            raise StalePull(f"{len(hits)} of the prefix's {stop} blocks are cached here")
        blocks = hits[first_block:stop]
        engine.block_pool.acquire(blocks)
        return blocks

    blocks = await asyncio.wrap_future(loop.submit(hold))
    try:
        left = max(0.0, sink.expires_at - time.time())
        await asyncio.get_running_loop().run_in_executor(
            _pushes, _push, connector, sink, rows, [b.block_id for b in blocks], layout,
            secret, left)
    finally:  # every read is done (the push's stream synchronized): give them back
        loop.submit(lambda engine: engine.block_pool.free(reversed(blocks)))
    return len(blocks) * layout.block_bytes * layout.num_layers


def _push(connector: Connector, sink: SinkInfo, rows: KVRows, block_ids: list[int],
          layout: KVLayout, secret: bytes | None, seconds: float) -> None:
    device = rows.caches[0].device
    bind_thread(device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        try:
            push(connector, sink, rows, block_ids, layout, secret=secret,
                 send_timeout=seconds, reply_timeout=seconds)
        finally:
            if stream is not None:
                stream.synchronize()


class Puller:
    """Pulls prompt prefixes into this node's prefix cache (see the module docstring)."""

    def __init__(self, decode: DecodeRole, peer: Callable[[str], auth.AuthedStub],
                 connector_name: str, layout: KVLayout, timeout_s: float) -> None:
        self.decode, self.peer, self.layout = decode, peer, layout
        self.connector_name, self.block_size = connector_name, layout.block_size
        self.timeout_s = timeout_s  # the whole pull: reserve, push, arrival
        self.pulled_tokens = 0  # since start: prompt tokens that came from peers
        self.pull_seconds = 0.0  # their pulls' time, the call to the KV's arrival
        self.pulls_failed = 0

    @property
    def pulled_bytes(self) -> int:
        blocks = self.pulled_tokens // self.block_size
        return blocks * self.layout.block_bytes * self.layout.num_layers

    async def pull(self, req: Request, address: str, tokens: int) -> int:
        """Bring the first `tokens` of `req`'s prompt (whole blocks, never its last
        token) from the node at `address` into this node's prefix cache; how many prompt
        tokens came (0: none, the prompt is computed as it is)."""
        bs = self.block_size
        num_blocks = min(tokens, req.num_prompt_tokens - 1) // bs
        if num_blocks < MIN_PULL_BLOCKS:
            return 0
        rid = req.request_id + PULL_SUFFIX
        prefix = Request(rid, req.prompt_token_ids[:num_blocks * bs], SamplingParams(max_tokens=1))
        deadline = time.monotonic() + self.timeout_s
        try:
            made = await asyncio.wait_for(
                asyncio.wrap_future(self.decode.reserve(prefix, self.timeout_s)), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - no room (KVCacheFull) or a namesake: compute
            log.info("no pull for %s: %s", req.request_id, exc)
            return 0
        if num_blocks - made.first_block < MIN_PULL_BLOCKS:  # cached here after all
            await asyncio.wrap_future(self.decode.abort(rid, "cached here"))
            return 0
        msg = pb.PullRequest(
            request=pb.Request(request_id=rid, prompt_token_ids=prefix.prompt_token_ids,
                               sampling=convert.sampling_to_pb(prefix.params)),
            sink=convert.sink_to_pb(made.sink, made.first_block, self.connector_name))
        began = time.monotonic()
        try:
            await self.peer(address).Pull(msg, timeout=max(0.0, deadline - time.monotonic()))
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(made.arrival)),
                                   max(0.0, deadline - time.monotonic()))
        except (grpc.aio.AioRpcError, TransferError, TimeoutError) as exc:
            why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("pull of %s's prefix from %s failed (%s); computing it", req.request_id,
                        address, why or type(exc).__name__)
            self.pulls_failed += 1
            await asyncio.wrap_future(self.decode.abort(rid, f"pull failed: {why}"))
            return 0
        self.pull_seconds += time.monotonic() - began
        await asyncio.wrap_future(self.decode.adopt(rid))
        pulled = (num_blocks - made.first_block) * bs
        self.pulled_tokens += pulled
        return pulled
