"""A prefill node's memory stays flat however long it runs: prompts of any length reach
oneDNN's packed GEMM as a fixed set of row counts (each count is a primitive oneDNN
compiles and keeps for good, ~0.6 MiB of SmolLM2's), and pushes leave no thread, pending
entry, live transfer or held block behind. What oneDNN runs is read from its verbose
log, one line per inner product executed."""

from __future__ import annotations

import ctypes
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from kv_helpers import BLOCK_SIZE, PoolBlocks, make_caches, wait_until

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.cpu_linear import linear, mkl_rows, packed_rows
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.agent import TransferAgent
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.tcp import TcpConnector
from tandem.node.loop import EngineLoop
from tandem.prefill_node.role import PrefillRole

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="the packed GEMM needs oneDNN")

ROW_COUNTS = [*range(1, 17), *range(18, 33, 2), *range(36, 65, 4), *range(72, 129, 8),
              *range(144, 257, 16)]
NUM_BLOCKS = 128  # of BLOCK_SIZE tokens, on either side: a 256-token prompt takes 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_EXEC = re.compile(r",exec,cpu,inner_product,.*,mb(\d+)ic(\d+)oc(\d+),", re.M)


def _inner_products(capfd: pytest.CaptureFixture[str], fn: Callable[[], None]
                    ) -> set[tuple[int, int, int]]:
    """The (rows, in, out) of every inner product oneDNN ran while fn() ran."""
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fn()
    ctypes.CDLL(None).fflush(None)  # oneDNN prints through C's buffered stdout
    return {(int(m), int(i), int(o)) for m, i, o in _EXEC.findall(capfd.readouterr().out)}


def test_packed_rows_are_48_counts_at_most_an_eighth_up() -> None:
    assert sorted({packed_rows(m) for m in range(1, 257)}) == ROW_COUNTS
    assert len(ROW_COUNTS) == 48
    assert [packed_rows(m) for m in range(1, 17)] == list(range(1, 17))
    assert all(m <= packed_rows(m) < m * 9 / 8 for m in range(17, 257))


def test_every_row_count_runs_as_one_of_48_primitives(capfd: pytest.CaptureFixture[str]
                                                      ) -> None:
    """1..300 rows through one weight: the results are torch's, and oneDNN ran exactly
    the 48 row counts (above 256 rows torch's GEMM runs, no oneDNN primitive; nor up to
    `mkl_rows`, where MKL has every thread torch has)."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(72, 40, generator=g), torch.randn(72, generator=g)
    xs = [torch.randn(m, 40, generator=g) for m in range(1, 301)]
    got: list[torch.Tensor] = []

    def run() -> None:
        with torch.inference_mode():
            got.extend(linear(x, weight, bias) for x in xs)

    ran = _inner_products(capfd, run)
    for x, y in zip(xs, got):
        torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    assert sorted(m for m, i, o in ran if (i, o) == (40, 72)) == [
        m for m in ROW_COUNTS if m > mkl_rows()]


@dataclass
class _Nodes:
    engine: LLMEngine
    loop: EngineLoop
    role: PrefillRole
    blocks: PoolBlocks
    agent: TransferAgent

    def prefill(self, rid: str, prompt: list[int]) -> None:
        """Push `prompt`'s KV into a fresh sink, wait until it is in, free the sink."""
        n = -(-len(prompt) // BLOCK_SIZE)
        sink = self.agent.reserve(rid, self.blocks.allocate(n), ttl_s=30.0)
        self.role.prefill(Request(rid, prompt, GREEDY), sink, 0)
        assert self.agent.wait_ready(rid, timeout=10)
        self.blocks.free(list(self.agent.release(rid)))

    def free_blocks(self) -> int:
        return self.loop.call(lambda e: e.block_pool.num_free_blocks, timeout=10)


@pytest.fixture
def nodes() -> Iterator[_Nodes]:
    engine = LLMEngine(EngineConfig(
        model="tiny", load_format="dummy", device="cpu", enforce_eager=True,
        cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_batched_tokens=256)))
    loop = EngineLoop(engine)
    layout = KVLayout.of(engine.runner.kv_caches, engine.model_name)
    connector = TcpConnector()
    role = PrefillRole(loop, connector, layout, send_timeout_s=5.0, reply_timeout_s=5.0)
    caches = make_caches(NUM_BLOCKS, num_layers=layout.num_layers, heads=layout.num_kv_heads,
                         head_dim=layout.head_dim)
    blocks = PoolBlocks(NUM_BLOCKS)
    agent = TransferAgent(caches, layout, connector, blocks.free)
    yield _Nodes(engine, loop, role, blocks, agent)
    agent.close()
    role.close()
    loop.close()
    connector.close()


def _thread_names() -> Counter[str]:
    return Counter(t.name for t in threading.enumerate())


def test_prefills_of_new_lengths_leave_nothing_behind(nodes: _Nodes,
                                                      capfd: pytest.CaptureFixture[str]
                                                      ) -> None:
    """Once prompts of the 48 packed lengths were prefilled and pushed, 40 more of other
    lengths up to 256 make oneDNN run no inner product it had not run (each new one would
    be a primitive kept for good), and leave the threads, the role's entries and the
    engine's free blocks as they were."""
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    def prefill_all(lengths: list[int], tag: str) -> None:
        for i, n in enumerate(lengths):
            nodes.prefill(f"{tag}{i}", prompt(n))

    warm = _inner_products(capfd, lambda: prefill_all(ROW_COUNTS, "warm"))
    threads = _thread_names()
    others = rng.sample(sorted(set(range(1, 257)) - set(ROW_COUNTS)), 40)
    ran = _inner_products(capfd, lambda: prefill_all(others, "new"))
    assert ran - warm == set()
    assert {m for m, _, _ in warm} == {m for m in ROW_COUNTS if m > mkl_rows()}
    # No thread left behind (a shared link idle long enough may close meanwhile: fewer).
    assert wait_until(lambda: not _thread_names() - threads, 20), _thread_names() - threads
    assert (nodes.role._pending, nodes.role._live) == ({}, set())
    assert nodes.free_blocks() == NUM_BLOCKS
    assert nodes.blocks.num_free == NUM_BLOCKS
    assert nodes.role.transfers_failed == 0
