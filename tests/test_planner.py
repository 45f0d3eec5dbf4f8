from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tandem.router.planner import (
    Decision,
    NodeSignals,
    Planner,
    PlannerSettings,
    Signals,
    decide,
)

NOW = 1_764_050_000.0
SLO = PlannerSettings(mode="slo")  # TTFT short > 600 ms, room < 400; ITL short > 60, room < 40
LOAD = PlannerSettings(mode="load")  # short: pressure > 1.2; room: < 0.8 with one node fewer


def node(address: str, role: str | None, *, state: str = "up", running: int = 0,
         waiting: int = 0, kv: float = 0.0, tokens: int = 0) -> NodeSignals:
    return NodeSignals(address=address, role=role, state=state, running=running,
                       waiting=waiting, kv_usage=kv, queued_prefill_tokens=tokens,
                       ttft_p90_ms=None, itl_p90_ms=None)


def signals(nodes: list[NodeSignals], ttft: float | None = None, itl: float | None = None,
            requests: int = 20) -> Signals:
    return Signals(nodes=nodes, ttft_p90_ms=ttft, itl_p90_ms=itl, num_requests=requests)


ONE_PREFILL_TWO_DECODE = [node("p1:1", "prefill", running=1), node("d1:1", "decode", running=3),
                          node("d2:1", "decode", running=1)]
TWO_PREFILL_ONE_DECODE = [node("p1:1", "prefill", waiting=1), node("p2:1", "prefill"),
                          node("d1:1", "decode", running=4)]


# Settings


def test_defaults_are_the_contract():
    assert PlannerSettings().as_dict() == {
        "mode": "off", "advisory": False, "interval_s": 5.0, "ttft_target_ms": 500.0,
        "itl_target_ms": 50.0, "hysteresis": 0.2, "cooldown_s": 30.0, "window_s": 60.0,
        "min_prefill": 1, "min_decode": 1}


@pytest.mark.parametrize("changes", [
    {"mode": "auto"}, {"mode": 1}, {"advisory": "yes"}, {"advisory": 1},
    {"interval_s": 0}, {"interval_s": -1.0}, {"interval_s": True}, {"interval_s": "5"},
    {"interval_s": float("nan")}, {"ttft_target_ms": 0}, {"itl_target_ms": -5.0},
    {"window_s": 0.0}, {"hysteresis": 1.0}, {"hysteresis": -0.1}, {"cooldown_s": -1},
    {"cooldown_s": float("inf")}, {"min_prefill": 0}, {"min_decode": 0},
    {"min_decode": 1.5}, {"min_prefill": 2.0}, {"min_prefill": None}, {"speed": 1},
])
def test_bad_setting_names_its_field(changes: dict):
    (name,) = changes
    with pytest.raises(ValueError) as raised:
        PlannerSettings(mode="slo").updated({"window_s": 30} | changes)
    assert raised.value.args[0] == name


def test_settings_must_be_an_object():
    with pytest.raises(ValueError) as raised:
        PlannerSettings().updated(["mode", "slo"])  # type: ignore[arg-type]
    assert raised.value.args[0] is None


def test_partial_update_keeps_the_rest():
    before = PlannerSettings(mode="load", cooldown_s=10.0)
    after = before.updated({"mode": "slo", "ttft_target_ms": 800, "advisory": True})
    assert after == PlannerSettings(mode="slo", advisory=True, ttft_target_ms=800.0,
                                    cooldown_s=10.0)
    assert type(after.ttft_target_ms) is float
    assert before.mode == "load" and before.updated({}) == before


# decide(), slo mode


def test_slo_ttft_miss_moves_the_least_loaded_decode_node():
    decision = decide(signals(ONE_PREFILL_TWO_DECODE, ttft=812, itl=12), SLO, NOW, None)
    assert decision is not None
    assert decision.as_dict() | {"inputs": None} == {
        "time": NOW, "mode": "slo", "advisory": False, "action": "switch", "node": "d2:1",
        "from": "decode", "to": "prefill",
        "reason": "prefill TTFT p90 812 ms > 600 ms while decode ITL p90 12 ms < 40 ms",
        "inputs": None, "outcome": "pending"}
    inputs = json.loads(json.dumps(decision.inputs))
    assert inputs | {"nodes": None} == {"ttft_p90_ms": 812, "itl_p90_ms": 12,
                                        "num_requests": 20, "prefill_up": 1, "decode_up": 2,
                                        "nodes": None}
    assert [n["address"] for n in inputs["nodes"]] == ["p1:1", "d1:1", "d2:1"]


def test_slo_itl_miss_moves_the_least_loaded_prefill_node():
    decision = decide(signals(TWO_PREFILL_ONE_DECODE, ttft=100, itl=90), SLO, NOW, None)
    assert (decision.node, decision.from_role, decision.to) == ("p2:1", "prefill", "decode")
    assert decision.reason == "decode ITL p90 90 ms > 60 ms while prefill TTFT p90 100 ms < 400 ms"


def test_slo_other_side_without_samples_has_room():
    decision = decide(signals(ONE_PREFILL_TWO_DECODE, ttft=812, itl=None), SLO, NOW, None)
    assert decision.reason == "prefill TTFT p90 812 ms > 600 ms while decode ITL p90 has no samples"
    decision = decide(signals(TWO_PREFILL_ONE_DECODE, ttft=None, itl=61), SLO, NOW, None)
    assert decision.reason == "decode ITL p90 61 ms > 60 ms while prefill TTFT p90 has no samples"


@pytest.mark.parametrize("ttft, itl", [
    (590, 12),  # over the TTFT target, within the band
    (812, 45),  # decode under its target but not by the band
    (812, 70),  # both short
    (300, 30),  # neither
    (None, None),
    (100, 55),  # over the ITL target, within the band
])
def test_slo_hysteresis_band_holds(ttft: float | None, itl: float | None):
    nodes = ONE_PREFILL_TWO_DECODE + [node("p2:1", "prefill")]
    assert decide(signals(nodes, ttft=ttft, itl=itl), SLO, NOW, None) is None


def test_slo_hysteresis_zero_acts_just_over_target():
    settings = SLO.updated({"hysteresis": 0})
    decision = decide(signals(ONE_PREFILL_TWO_DECODE, ttft=501, itl=49), settings, NOW, None)
    assert decision.reason == "prefill TTFT p90 501 ms > 500 ms while decode ITL p90 49 ms < 50 ms"


def test_too_few_requests_hold():
    assert decide(signals(ONE_PREFILL_TWO_DECODE, 812, 12, requests=4), SLO, NOW, None) is None
    assert decide(signals(ONE_PREFILL_TWO_DECODE, 812, 12, requests=5), SLO, NOW, None)


def test_cooldown():
    short = signals(ONE_PREFILL_TWO_DECODE, ttft=812, itl=12)
    assert decide(short, SLO, NOW, NOW - 29.9) is None
    assert decide(short, SLO, NOW, NOW - 30.0) is not None
    assert decide(short, SLO.updated({"cooldown_s": 0}), NOW, NOW) is not None


def test_mode_off_never_decides():
    assert decide(signals(ONE_PREFILL_TWO_DECODE, 812, 12), PlannerSettings(), NOW, None) is None


def test_pool_minimum_counts_only_up_nodes():
    nodes = [node("p1:1", "prefill"), node("d1:1", "decode", running=5),
             node("d2:1", "decode", state="draining"), node("d3:1", "decode", state="down")]
    assert decide(signals(nodes, ttft=812, itl=12), SLO, NOW, None) is None
    nodes = [node("p1:1", "prefill", state="draining"), node("p2:1", "prefill", state="down"),
             node("p3:1", "prefill"), node("d1:1", "decode")]
    assert decide(signals(nodes, ttft=100, itl=90), SLO, NOW, None) is None


def test_pool_minimum_from_settings():
    three = ONE_PREFILL_TWO_DECODE + [node("d3:1", "decode", running=2)]
    short = signals(three, ttft=812, itl=12)
    assert decide(short, SLO.updated({"min_decode": 3}), NOW, None) is None
    assert decide(short, SLO.updated({"min_decode": 2}), NOW, None).node == "d2:1"
    short = signals(TWO_PREFILL_ONE_DECODE, ttft=100, itl=90)
    assert decide(short, SLO.updated({"min_prefill": 2}), NOW, None) is None


def test_least_loaded_is_up_and_known():
    nodes = [node("p1:1", "prefill"),
             node("d1:1", "decode", running=3, kv=0.1),
             node("d2:1", "decode", running=1, waiting=2, kv=0.05),  # 3 too, less KV
             node("d3:1", "decode", running=4),
             node("d4:1", "decode", state="draining"),
             node("d5:1", "decode", state="down"),
             node("x1:1", None)]
    decision = decide(signals(nodes, ttft=812, itl=12), SLO, NOW, None)
    assert decision.node == "d2:1"
    assert decision.inputs["decode_up"] == 3


# decide(), load mode


def test_load_prefill_queue_takes_a_decode_node():
    nodes = [node("p1:1", "prefill", waiting=6, tokens=1000),
             node("d1:1", "decode", running=3, kv=0.2), node("d2:1", "decode", running=2, kv=0.2)]
    decision = decide(signals(nodes, requests=0), LOAD, NOW, None)
    assert (decision.node, decision.to) == ("d2:1", "prefill")
    assert decision.reason == (
        "prefill pressure 1.50 > 1.20 (6.0 waiting, 1000 queued tokens per node) while decode "
        "pressure with one node fewer 0.62 < 0.80 (KV 20%, 0.0 waiting per node)")
    assert decision.inputs | {"nodes": None} == {
        "prefill_waiting": 6.0, "prefill_queued_tokens": 1000.0, "prefill_pressure": 1.5,
        "decode_kv_usage": 0.2, "decode_waiting": 0.0, "decode_pressure": 0.2 / 0.65,
        "prefill_up": 1, "decode_up": 2, "nodes": None}


def test_load_queued_tokens_alone_count():
    nodes = [node("p1:1", "prefill", tokens=6000), node("d1:1", "decode"), node("d2:1", "decode")]
    assert decide(signals(nodes), LOAD, NOW, None).to == "prefill"


def test_load_full_decode_takes_an_idle_prefill_node():
    nodes = [node("p1:1", "prefill", running=1), node("p2:1", "prefill"),
             node("d1:1", "decode", kv=0.9)]
    decision = decide(signals(nodes), LOAD, NOW, None)
    assert (decision.node, decision.from_role, decision.to) == ("p2:1", "prefill", "decode")
    assert decision.reason == (
        "decode pressure 1.38 > 1.20 (KV 90%, 0.0 waiting per node) while prefill pressure "
        "with one node fewer 0.00 < 0.80 (0.0 waiting, 0 queued tokens per node)")


def test_load_decode_waiting_alone_counts():
    nodes = [node("p1:1", "prefill"), node("p2:1", "prefill"),
             node("d1:1", "decode", kv=0.3, waiting=2)]
    assert decide(signals(nodes), LOAD, NOW, None).to == "decode"


@pytest.mark.parametrize("nodes", [
    # prefill pressure 1.1: over target, within the band
    [node("p1:1", "prefill", waiting=4, tokens=4500), node("d1:1", "decode"),
     node("d2:1", "decode")],
    # decode under target now (0.46) but not with one node fewer (0.92)
    [node("p1:1", "prefill", waiting=8), node("d1:1", "decode", kv=0.3),
     node("d2:1", "decode", kv=0.3)],
    # both pools short
    [node("p1:1", "prefill", waiting=8), node("p2:1", "prefill", waiting=8),
     node("d1:1", "decode", kv=0.95), node("d2:1", "decode", kv=0.95)],
    # decode full, but the prefill pool has work that one node fewer would double
    [node("p1:1", "prefill", waiting=2), node("p2:1", "prefill", waiting=2),
     node("d1:1", "decode", kv=0.95)],
    # idle
    [node("p1:1", "prefill"), node("p2:1", "prefill"), node("d1:1", "decode"),
     node("d2:1", "decode")],
])
def test_load_band_holds(nodes: list[NodeSignals]):
    assert decide(signals(nodes), LOAD, NOW, None) is None


def test_load_respects_minimum_and_cooldown():
    nodes = [node("p1:1", "prefill", waiting=8), node("d1:1", "decode"),
             node("d2:1", "decode", state="draining")]
    assert decide(signals(nodes), LOAD, NOW, None) is None
    nodes[2] = node("d2:1", "decode")
    assert decide(signals(nodes), LOAD, NOW, NOW - 10) is None
    assert decide(signals(nodes), LOAD, NOW, NOW - 30).to == "prefill"


# Planner


class Router:
    """The router's side as the planner sees it: signals to read, a switch executor."""

    def __init__(self, read: Signals | Exception, fail: str | None = None) -> None:
        self.read, self.fail = read, fail
        self.windows: list[float] = []
        self.switches: list[tuple[str, str]] = []
        self.actions: list[Decision] = []

    def read_signals(self, window_s: float) -> Signals:
        self.windows.append(window_s)
        if isinstance(self.read, Exception):
            raise self.read
        return self.read

    async def switch(self, address: str, role: str) -> None:
        self.switches.append((address, role))
        if self.fail is not None:
            raise RuntimeError(self.fail)

    def planner(self, settings: PlannerSettings) -> Planner:
        return Planner(settings, self.read_signals, self.switch, self.actions.append)


SHORT_PREFILL = signals(ONE_PREFILL_TWO_DECODE, ttft=812, itl=12)


def test_step_switches_and_cools_down(caplog: pytest.LogCaptureFixture):
    router = Router(SHORT_PREFILL)
    planner = router.planner(SLO)
    with caplog.at_level(logging.INFO, logger="tandem.router.planner"):
        decision = asyncio.run(planner.step(NOW))
    assert decision.outcome == "done"
    assert router.switches == [("d2:1", "prefill")]
    assert router.actions == [decision] and list(planner.decisions) == [decision]
    assert decision.inputs["window_s"] == 60.0
    line = caplog.records[0]
    assert line.name == "tandem.router.planner" and line.levelno == logging.INFO
    assert decision.reason in line.getMessage() and '"ttft_p90_ms": 812' in line.getMessage()
    assert asyncio.run(planner.step(NOW + 29)) is None
    assert router.switches == [("d2:1", "prefill")]
    # After a switch only signals from after it are read.
    assert router.windows[-1] == pytest.approx(29, abs=0.5)
    assert asyncio.run(planner.step(NOW + 31)).outcome == "done"
    assert len(router.switches) == 2 and len(router.actions) == 2


def test_step_advisory_switches_nothing():
    router = Router(SHORT_PREFILL)
    planner = router.planner(SLO.updated({"advisory": True}))
    decision = asyncio.run(planner.step(NOW))
    assert (decision.outcome, decision.advisory) == ("advised", True)
    assert router.switches == [] and router.actions == []
    assert asyncio.run(planner.step(NOW + 10)) is None  # the cool-down applies as if it acted
    assert asyncio.run(planner.step(NOW + 30)).outcome == "advised"
    assert router.windows == [60.0, 60.0, 60.0]  # nothing changed, nothing to forget


def test_step_failed_switch_cools_down():
    router = Router(SHORT_PREFILL, fail="switch_timeout: not drained in 60 s")
    planner = router.planner(SLO)
    decision = asyncio.run(planner.step(NOW))
    assert decision.outcome == "failed: switch_timeout: not drained in 60 s"
    assert router.actions == []
    assert asyncio.run(planner.step(NOW + 5)) is None
    assert router.switches == [("d2:1", "prefill")]
    assert router.windows == [60.0, 60.0]
    assert asyncio.run(planner.step(NOW + 31)).outcome.startswith("failed: ")
    assert len(router.switches) == 2


def test_step_mode_off_reads_nothing():
    router = Router(SHORT_PREFILL)
    assert asyncio.run(router.planner(PlannerSettings()).step(NOW)) is None
    assert router.windows == [] and router.switches == []


def test_decisions_keep_the_newest_100():
    planner = Router(SHORT_PREFILL).planner(SLO.updated({"advisory": True, "cooldown_s": 0}))

    async def steps() -> None:
        for i in range(105):
            await planner.step(float(i))

    asyncio.run(steps())
    assert [d.time for d in planner.decisions] == [float(i) for i in range(5, 105)]


def test_update_validates():
    planner = Router(SHORT_PREFILL).planner(SLO)
    with pytest.raises(ValueError) as raised:
        planner.update({"hysteresis": 1})
    assert raised.value.args[0] == "hysteresis" and planner.settings == SLO
    assert planner.update({"mode": "load"}) == planner.settings == LOAD


def test_never_two_switches_at_once():
    router = Router(SHORT_PREFILL)
    planner = router.planner(SLO)
    release, busy, most = asyncio.Event(), [0], [0]

    async def slow_switch(address: str, role: str) -> None:
        busy[0] += 1
        most[0] = max(most[0], busy[0])
        await release.wait()
        busy[0] -= 1

    planner.switch = slow_switch

    async def two_steps() -> list[Decision | None]:
        first = asyncio.create_task(planner.step(NOW))
        second = asyncio.create_task(planner.step(NOW))
        await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(first, second)

    first, second = asyncio.run(two_steps())
    assert first.outcome == "done" and second is None and most[0] == 1


def test_run_survives_errors_and_reads_settings_each_interval(
        caplog: pytest.LogCaptureFixture):
    router = Router(RuntimeError("registry unreadable"), fail="node went away")
    planner = router.planner(SLO.updated({"interval_s": 0.001, "cooldown_s": 0}))

    async def run_until_two_failed_switches() -> None:
        task = asyncio.create_task(planner.run())
        while len(router.windows) < 3:
            await asyncio.sleep(0.001)
        router.read = SHORT_PREFILL
        while len(router.switches) < 2:
            await asyncio.sleep(0.001)
        planner.update({"mode": "off"})
        reads = len(router.windows)
        await asyncio.sleep(0.02)
        assert len(router.windows) == reads  # off: nothing read any more
        assert not task.done()
        task.cancel()

    with caplog.at_level(logging.INFO, logger="tandem.router.planner"):
        asyncio.run(asyncio.wait_for(run_until_two_failed_switches(), 5))
    assert any(r.getMessage() == "planner step failed" and r.exc_info for r in caplog.records)
    assert all(d.outcome == "failed: node went away" for d in planner.decisions)
    assert router.actions == []
