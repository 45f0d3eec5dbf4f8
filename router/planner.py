"""The planner: moves one node at a time between the prefill and decode pools, in place
(drain, flip the role, no weight reload), when one pool is short and the other has room.

Every `interval_s` it reads the router's signals over the last `window_s` seconds: per
node its role, state, running and waiting requests, KV cache usage and queued prompt
tokens; over the whole router the 90th-percentile time to first token (TTFT, set by the
prefill pool) and inter-token latency (ITL, set by the decode pool), and how many
requests finished in the window. Only nodes that are up count; draining or down nodes
are neither moved nor counted towards a pool.

Two modes decide:

- `slo`: latency targets. When TTFT p90 misses its target while ITL p90 is comfortably
  within its own, a decode node becomes a prefill node, and the reverse. With fewer than
  five requests in the window the percentiles mean little, and nothing moves.
- `load`: no latency targets, queues instead. Prefill pressure is the larger of the
  waiting requests and the queued prompt tokens per prefill node, each over its target
  below; decode pressure the larger of KV usage and waiting requests per decode node
  over theirs. A pool above target takes a node from the other when the other, with
  one node fewer, would still be well below its own target.

Hysteresis `h` keeps it from flapping: a pool is short only beyond target x (1 + h) and
has room only under target x (1 - h), so between the two nothing moves either way.
After any action the planner waits `cooldown_s` before the next, counted from the end
of the switch, and after a switch it reads signals only from after it, since the older
ones describe pools that no longer exist. A move never leaves a pool with fewer up
nodes than `min_prefill` / `min_decode`. The node moved is the least loaded of its pool
(running + waiting, then KV usage), so the fewest requests wait on its drain.

In advisory mode the planner decides and records as usual, and switches nothing: the
decision's outcome is "advised" and the cool-down applies as if it had acted. The last
100 decisions are kept for `GET /admin/v1/planner`; `PUT` changes settings, which take
effect at the next interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

MODES = ("off", "slo", "load")
MAX_DECISIONS = 100  # kept for GET /admin/v1/planner, newest last
MIN_REQUESTS = 5  # slo mode: fewer finished requests in the window give no usable p90

# Load mode: each signal's target; a pool's pressure is its worst signal over target.
PREFILL_WAITING_TARGET = 4.0  # prompts queued per prefill node: past a few, each waits a batch
PREFILL_TOKENS_TARGET = 4096.0  # queued prompt tokens per prefill node: two 2048-token steps
DECODE_KV_TARGET = 0.65  # KV in use per decode node: acting at 0.78 (h 0.2) precedes preemption
DECODE_WAITING_TARGET = 1.0  # requests a decode node cannot admit: a queue there means it is full

OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}
Move = tuple[str, str]  # (the role a node moves to, why)


class InvalidSetting(ValueError):
    """args: (field, message); the router answers 400 `invalid_setting` with param=field."""

    def __init__(self, name: str | None, message: str) -> None:
        super().__init__(name, message)
        self.field = name
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass(frozen=True)
class PlannerSettings:
    mode: str = "off"  # off | slo | load
    advisory: bool = False  # decide and record, switch nothing
    interval_s: float = 5.0
    ttft_target_ms: float = 500.0  # slo mode
    itl_target_ms: float = 50.0  # slo mode
    hysteresis: float = 0.2  # short beyond target x (1 + h), room under target x (1 - h)
    cooldown_s: float = 30.0  # no action within this long of the last one
    window_s: float = 60.0  # signals are read over this window
    min_prefill: int = 1
    min_decode: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidSetting("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("interval_s", "ttft_target_ms", "itl_target_ms", "hysteresis",
                     "cooldown_s", "window_s"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidSetting(name, f"must be a finite number, got {getattr(self, name)}")
        for name in ("interval_s", "ttft_target_ms", "itl_target_ms", "window_s"):
            if getattr(self, name) <= 0:
                raise InvalidSetting(name, f"must be > 0, got {getattr(self, name)}")
        if not 0 <= self.hysteresis < 1:
            raise InvalidSetting("hysteresis", f"must be in [0, 1), got {self.hysteresis}")
        if self.cooldown_s < 0:
            raise InvalidSetting("cooldown_s", f"must be >= 0, got {self.cooldown_s}")
        for name in ("min_prefill", "min_decode"):
            if getattr(self, name) < 1:
                raise InvalidSetting(name, f"must be >= 1, got {getattr(self, name)}")

    def updated(self, changes: dict) -> PlannerSettings:
        """These settings with `changes` (a partial Settings from JSON) applied and checked."""
        if not isinstance(changes, dict):
            raise InvalidSetting(None, "settings must be a JSON object")
        known = {f.name for f in dataclasses.fields(self)}
        typed: dict[str, object] = {}
        for name, value in changes.items():
            if name not in known:
                raise InvalidSetting(name, "unknown setting")
            typed[name] = _typed(name, value, type(getattr(self, name)))
        return dataclasses.replace(self, **typed)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _typed(name: str, value: object, kind: type) -> object:
    """`value` as `kind` (the field's type), or InvalidSetting; JSON ints pass as floats."""
    if isinstance(value, bool) != (kind is bool):  # bool is an int: never a number here
        raise InvalidSetting(name, f"must be {kind.__name__}, got {value!r}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise InvalidSetting(name, f"must be {kind.__name__}, got {value!r}")
    return value


@dataclass(frozen=True)
class NodeSignals:
    address: str
    role: str | None  # prefill | decode; None until the router learns it (never counted)
    state: str  # up | draining | down
    running: int
    waiting: int
    kv_usage: float  # 0..1
    queued_prefill_tokens: int
    ttft_p90_ms: float | None  # over the window; None: no samples
    itl_p90_ms: float | None


@dataclass(frozen=True)
class Signals:
    nodes: Sequence[NodeSignals]
    ttft_p90_ms: float | None  # the whole router over the window; None: no samples
    itl_p90_ms: float | None
    num_requests: int  # finished in the window


@dataclass
class Decision:
    time: float  # unix
    mode: str
    advisory: bool
    node: str
    from_role: str
    to: str
    reason: str  # one sentence with the numbers
    inputs: dict  # what it read, JSON-serializable
    action: str = "switch"
    outcome: str = "pending"  # then done | advised | failed: <why>

    def as_dict(self) -> dict:
        return {"time": self.time, "mode": self.mode, "advisory": self.advisory,
                "action": self.action, "node": self.node, "from": self.from_role,
                "to": self.to, "reason": self.reason, "inputs": self.inputs,
                "outcome": self.outcome}


def decide(signals: Signals, settings: PlannerSettings, now: float,
           last_action_at: float | None) -> Decision | None:
    """The one switch these signals call for, or None. Pure: the caller acts and records."""
    if settings.mode == "off":
        return None
    if last_action_at is not None and now - last_action_at < settings.cooldown_s:
        return None
    pools = {role: [n for n in signals.nodes if n.role == role and n.state == "up"]
             for role in OTHER_ROLE}
    rule = _slo_move if settings.mode == "slo" else _load_move
    move, inputs = rule(signals, settings, pools)
    if move is None:
        return None
    to, reason = move
    giving = pools[OTHER_ROLE[to]]
    minimum = settings.min_prefill if to == "decode" else settings.min_decode
    if len(giving) <= minimum:
        return None
    node = min(giving, key=lambda n: (n.running + n.waiting, n.kv_usage, n.address))
    inputs |= {"prefill_up": len(pools["prefill"]), "decode_up": len(pools["decode"]),
               "nodes": [dataclasses.asdict(n) for n in signals.nodes]}
    return Decision(time=now, mode=settings.mode, advisory=settings.advisory,
                    node=node.address, from_role=node.role, to=to, reason=reason,
                    inputs=inputs)


def _slo_move(signals: Signals, s: PlannerSettings,
              pools: dict[str, list[NodeSignals]]) -> tuple[Move | None, dict]:
    ttft, itl = signals.ttft_p90_ms, signals.itl_p90_ms
    inputs = {"ttft_p90_ms": ttft, "itl_p90_ms": itl, "num_requests": signals.num_requests}
    if signals.num_requests < MIN_REQUESTS:
        return None, inputs
    high, low = 1 + s.hysteresis, 1 - s.hysteresis
    ttft_high, ttft_low = s.ttft_target_ms * high, s.ttft_target_ms * low
    itl_high, itl_low = s.itl_target_ms * high, s.itl_target_ms * low
    if ttft is not None and ttft > ttft_high and (itl is None or itl < itl_low):
        why = f"prefill TTFT p90 {ttft:.0f} ms > {ttft_high:.0f} ms while "
        return ("prefill", why + _under("decode ITL p90", itl, itl_low)), inputs
    if itl is not None and itl > itl_high and (ttft is None or ttft < ttft_low):
        why = f"decode ITL p90 {itl:.0f} ms > {itl_high:.0f} ms while "
        return ("decode", why + _under("prefill TTFT p90", ttft, ttft_low)), inputs
    return None, inputs


def _under(what: str, ms: float | None, limit: float) -> str:
    return f"{what} has no samples" if ms is None else f"{what} {ms:.0f} ms < {limit:.0f} ms"


def _load_move(signals: Signals, s: PlannerSettings,
               pools: dict[str, list[NodeSignals]]) -> tuple[Move | None, dict]:
    prefill, decode = pools["prefill"], pools["decode"]
    p_waiting, p_tokens = _mean(prefill, "waiting"), _mean(prefill, "queued_prefill_tokens")
    d_kv, d_waiting = _mean(decode, "kv_usage"), _mean(decode, "waiting")
    p = max(p_waiting / PREFILL_WAITING_TARGET, p_tokens / PREFILL_TOKENS_TARGET)
    d = max(d_kv / DECODE_KV_TARGET, d_waiting / DECODE_WAITING_TARGET)
    inputs = {"prefill_waiting": p_waiting, "prefill_queued_tokens": p_tokens,
              "prefill_pressure": p, "decode_kv_usage": d_kv, "decode_waiting": d_waiting,
              "decode_pressure": d}
    high, low = 1 + s.hysteresis, 1 - s.hysteresis
    prefill_text = f"({p_waiting:.1f} waiting, {p_tokens:.0f} queued tokens per node)"
    decode_text = f"(KV {d_kv:.0%}, {d_waiting:.1f} waiting per node)"
    # The giving pool's load spreads over one node fewer: it must still have room after.
    d_after, p_after = _one_fewer(d, len(decode)), _one_fewer(p, len(prefill))
    if p > high and d_after < low:
        return ("prefill", f"prefill pressure {p:.2f} > {high:.2f} {prefill_text} while "
                f"decode pressure with one node fewer {d_after:.2f} < {low:.2f} "
                f"{decode_text}"), inputs
    if d > high and p_after < low:
        return ("decode", f"decode pressure {d:.2f} > {high:.2f} {decode_text} while "
                f"prefill pressure with one node fewer {p_after:.2f} < {low:.2f} "
                f"{prefill_text}"), inputs
    return None, inputs


def _mean(nodes: list[NodeSignals], name: str) -> float:
    return sum(getattr(n, name) for n in nodes) / len(nodes) if nodes else 0.0


def _one_fewer(pressure: float, nodes: int) -> float:
    return pressure * nodes / (nodes - 1) if nodes > 1 else math.inf


class Planner:
    """Runs `decide` every interval and carries out its switches, one at a time."""

    def __init__(self, settings: PlannerSettings, read_signals: Callable[[float], Signals],
                 switch: Callable[[str, str], Awaitable[None]],
                 on_action: Callable[[Decision], None] | None = None) -> None:
        self.settings = settings
        self.read_signals = read_signals  # (window_s) -> Signals, from the router
        self.switch = switch  # (address, role): drain, flip, healthy in the other pool
        self.on_action = on_action  # called for each switch done
        self.decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS)
        self.last_action_at: float | None = None  # cool-down: advised, done or failed
        self.last_switch_at: float | None = None  # signals older than this are stale
        self._one_at_a_time = asyncio.Lock()

    def update(self, changes: dict) -> PlannerSettings:
        self.settings = self.settings.updated(changes)
        return self.settings

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)  # read each time: a PUT takes effect
            try:
                await self.step()
            except Exception:  # a bad read must not stop the planner
                log.exception("planner step failed")

    async def step(self, now: float | None = None) -> Decision | None:
        """One interval's work without the sleep; the decision it made, if any."""
        async with self._one_at_a_time:
            now = time.time() if now is None else now
            settings = self.settings
            if settings.mode == "off":
                return None
            window_s = settings.window_s
            if self.last_switch_at is not None:
                window_s = min(window_s, max(now - self.last_switch_at, 0.0))
            decision = decide(self.read_signals(window_s), settings, now, self.last_action_at)
            if decision is None:
                return None
            decision.inputs["window_s"] = window_s
            log.info("planner %s%s: %s %s -> %s: %s; inputs %s", settings.mode,
                     " (advisory)" if settings.advisory else "", decision.node,
                     decision.from_role, decision.to, decision.reason,
                     json.dumps(decision.inputs))
            self.decisions.append(decision)
            if settings.advisory:
                decision.outcome = "advised"
                self.last_action_at = now
            else:
                await self._carry_out(decision, now)
            return decision

    async def _carry_out(self, decision: Decision, now: float) -> None:
        started = time.monotonic()
        try:
            await self.switch(decision.node, decision.to)
        except Exception as exc:  # the outcome says why; the cool-down stops a hot retry
            decision.outcome = f"failed: {str(exc) or type(exc).__name__}"
            log.warning("planner: switching %s to %s %s", decision.node, decision.to,
                        decision.outcome)
        else:
            decision.outcome = "done"
            log.info("planner: %s is now %s", decision.node, decision.to)
        # On the caller's clock (tests pass `now`), from the end of the switch.
        self.last_action_at = now + time.monotonic() - started
        if decision.outcome == "done":
            self.last_switch_at = self.last_action_at
            if self.on_action is not None:
                self.on_action(decision)
