"""The admin API (`/admin/v1`, behind the admin token: router/guard.py) and the operations
behind it, which the planner uses too: list the nodes with their load, add and remove
nodes, drain and undrain them, switch a node's role in place, read and set the planner.

A drain is the node's own (its Health says so), so every router over the node sees it
and sends it nothing new; running requests finish. A role switch asks the node to drain
and flip (`SetRole`: the weights stay loaded), then waits until its Health shows it up in
the other pool. Nothing that would leave a pool without an up node is done: such a call
gets 409 and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import grpc
from fastapi import FastAPI, Request

from tandem.node.timeouts import TIMEOUTS
from tandem.protos import node_pb2 as pb
from tandem.router.planner import InvalidSetting, NodeSignals, Planner, Signals
from tandem.router.pool import DOWN, UP, NodeClient, Pool, role_name
from tandem.router.protocol import APIError

log = logging.getLogger(__name__)

PREFIX = "/admin/v1"
LOAD_WINDOW_S = 60.0  # the load a node listing shows: over the last minute
BACK_IN_SERVICE_S = 15.0  # after a role switch, its Health must show it up by then
_ROLES = {"prefill": pb.PREFILL, "decode": pb.DECODE}
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:.]+\]:\d{1,5}$")


class Operations:
    """What an operator (or the planner) may do to the router's nodes."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def node(self, address: str) -> NodeClient:
        node = self.pool.find(address)
        if node is None:
            raise APIError(f"no node {address!r} in this router", status=404,
                           code="unknown_node")
        return node

    async def add(self, address: str, role: str | None) -> NodeClient:
        if not _ADDRESS.match(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
            raise APIError(f"{address!r} is not host:port", "address")
        try:
            return await self.pool.add(address, _role(role) if role else pb.ROLE_UNSPECIFIED)
        except LookupError as exc:
            raise APIError(str(exc), "address", code="node_unreachable") from None
        except ValueError as exc:
            exists = self.pool.find(address) is not None
            raise APIError(str(exc), "address" if exists else "role",
                           status=409 if exists else 400,
                           code="node_exists" if exists else "role_mismatch") from None

    async def remove(self, node: NodeClient, force: bool, timeout_s: float) -> None:
        """Drained first (unless `force`), then forgotten; the node itself takes new
        requests again (another router may use it)."""
        self._keep_pool(node, "remove")
        if not force:
            await self._drain(node, True)
            if not await self._until_idle(node, timeout_s):
                await self._drain(node, False)
                raise APIError(f"{node.name} still has requests after {timeout_s:g}s; "
                               f"nothing was removed (or use force)", status=504,
                               code="drain_timeout")
        self.pool.remove(node)
        if not force:
            await self._drain(node, False, quiet=True)
        await node.close()
        log.info("%s removed", node.name)

    async def drain(self, node: NodeClient) -> None:
        self._keep_pool(node, "drain")
        await self._drain(node, True)

    async def undrain(self, node: NodeClient) -> None:
        await self._drain(node, False)

    async def set_role(self, node: NodeClient, role: str, timeout_s: float) -> None:
        """Drain, flip, and back in service in the other pool; 504 when the node still
        has requests after `timeout_s` (it keeps its role and takes requests again)."""
        target = _role(role)
        if node.role == target:
            return
        self._keep_pool(node, "switch")
        if node.switching_to is not None:
            raise APIError(f"{node.name} is switching already", status=409,
                           code="switch_in_progress")
        node.switching_to = target
        try:
            reply = await node.stub.SetRole(
                pb.SetRoleRequest(role=target, drain_timeout_s=timeout_s),
                timeout=timeout_s + TIMEOUTS.control_s)
            if not reply.drained:
                await node.poll()
                raise APIError(f"{node.name} still had requests after {timeout_s:g}s; its "
                               f"role is unchanged", status=504, code="switch_timeout")
            deadline = time.monotonic() + BACK_IN_SERVICE_S
            await node.poll()
            while not (node.role == target and node.state == UP):
                if time.monotonic() > deadline:
                    raise APIError(f"{node.name} took the {role} role but is {node.state}",
                                   status=502, kind="server_error", code="switch_failed")
                await asyncio.sleep(0.2)
                await node.poll()
        except grpc.aio.AioRpcError as exc:
            raise _node_error(node, exc) from None
        finally:
            node.switching_to = None

    def _keep_pool(self, node: NodeClient, what: str) -> None:
        """409 when `node` is the last up node of its pool."""
        if node.state != UP:
            return
        others = [n for n in self.pool.nodes
                  if n is not node and n.role == node.role and n.state == UP]
        if not others:
            pool = role_name(node.role)
            raise APIError(f"cannot {what} {node.address}: it is the last up node of the "
                           f"{pool} pool", status=409,
                           code="pool_would_be_empty" if what == "switch" else "last_in_pool")

    async def _drain(self, node: NodeClient, drain: bool, quiet: bool = False) -> None:
        try:
            await node.stub.Drain(pb.DrainRequest(drain=drain), timeout=TIMEOUTS.control_s)
        except grpc.aio.AioRpcError as exc:
            if quiet:
                return
            raise _node_error(node, exc) from None
        node.drains += 1
        if node.health is not None:  # seen here at once, not at the next poll
            node.health.accepting = not drain

    async def _until_idle(self, node: NodeClient, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                left = await node.stub.Drain(pb.DrainRequest(drain=True),
                                             timeout=TIMEOUTS.control_s)
                if left.num_requests == 0 and node.in_flight == 0:
                    return True
            except grpc.aio.AioRpcError:
                if node.state == DOWN:
                    return True  # nothing left to wait for
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)

    def signals(self, window_s: float) -> Signals:
        """What the planner reads: each node's load and latencies, and this router's."""
        nodes = []
        for n in self.pool.nodes:
            s, ttft, itl = n.stats, n.ttft.percentiles(window_s), n.itl.percentiles(window_s)
            nodes.append(NodeSignals(
                address=n.address, role=role_name(n.role) or "", state=n.state,
                running=s.num_running if s else 0,
                waiting=_waiting(n),
                kv_usage=_kv_usage(s), queued_prefill_tokens=n.queued_prefill_tokens(),
                ttft_p90_ms=ttft["p90"] * 1e3 if ttft else None,
                itl_p90_ms=itl["p90"] * 1e3 if itl else None))
        ttft, itl = self.pool.ttft.percentiles(window_s), self.pool.itl.percentiles(window_s)
        return Signals(nodes=nodes, ttft_p90_ms=ttft["p90"] * 1e3 if ttft else None,
                       itl_p90_ms=itl["p90"] * 1e3 if itl else None,
                       num_requests=len(self.pool.ttft.values(window_s)))

    async def switch(self, address: str, role: str) -> None:
        """The planner's action: as `set_role`, its APIError's message as the failure."""
        try:
            await self.set_role(self.node(address), role, TIMEOUTS.prefill_s)
        except APIError as exc:
            raise RuntimeError(exc.message) from None


def node_json(node: NodeClient, window_s: float = LOAD_WINDOW_S) -> dict[str, Any]:
    s, h = node.stats, node.health
    rates = node.rates.per_second(window_s)

    def ms(p: dict[str, float] | None) -> dict[str, float] | None:
        return None if p is None else {k: round(v * 1e3, 3) for k, v in p.items()}

    return {
        "address": node.address, "role": role_name(node.role), "state": node.state,
        "switching_to": role_name(node.switching_to) if node.switching_to else None,
        "pid": h.pid if h else 0, "loaded_at": h.loaded_at if h else 0.0,
        "in_flight": node.in_flight,
        "load": {
            "running": s.num_running if s else 0, "waiting": _waiting(node),
            "reserved": s.num_reserved if s else 0, "kv_usage": round(_kv_usage(s), 4),
            "prompt_tokens_per_s": round(rates[0], 3) if rates else 0.0,
            "generation_tokens_per_s": round(rates[1], 3) if rates else 0.0,
            "ttft_ms": ms(node.ttft.percentiles(window_s)),
            "itl_ms": ms(node.itl.percentiles(window_s)),
            "requests_last_minute": len(node.ttft.values(window_s)),
        },
    }


def add_admin_routes(app: FastAPI, ops: Operations, planner: Planner) -> None:
    @app.get(f"{PREFIX}/nodes")
    async def list_nodes() -> dict[str, Any]:
        return {"nodes": [node_json(n) for n in ops.pool.nodes]}

    @app.post(f"{PREFIX}/nodes", status_code=201)
    async def add_node(request: Request) -> dict[str, Any]:
        body = await _json(request)
        address, role = body.get("address"), body.get("role")
        if not isinstance(address, str):
            raise APIError("address (host:port) is required", "address")
        if role is not None and not isinstance(role, str):
            raise APIError("role must be prefill, decode or null", "role")
        return {"node": node_json(await ops.add(address, role))}

    @app.delete(PREFIX + "/nodes/{address}")
    async def remove_node(address: str, force: bool = False, timeout_s: float = 60.0
                          ) -> dict[str, Any]:
        node = ops.node(address)
        await ops.remove(node, force, _positive(timeout_s, "timeout_s"))
        return {"node": node_json(node)}

    @app.post(PREFIX + "/nodes/{address}/drain")
    async def drain(address: str) -> dict[str, Any]:
        node = ops.node(address)
        await ops.drain(node)
        return {"node": node_json(node)}

    @app.post(PREFIX + "/nodes/{address}/undrain")
    async def undrain(address: str) -> dict[str, Any]:
        node = ops.node(address)
        await ops.undrain(node)
        return {"node": node_json(node)}

    @app.post(PREFIX + "/nodes/{address}/role")
    async def set_role(address: str, request: Request) -> dict[str, Any]:
        body = await _json(request)
        node = ops.node(address)
        timeout_s = body.get("timeout_s", 60.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise APIError("timeout_s must be a number of seconds", "timeout_s")
        await ops.set_role(node, body.get("role"), _positive(timeout_s, "timeout_s"))
        return {"node": node_json(node)}

    @app.get(f"{PREFIX}/planner")
    async def planner_show() -> dict[str, Any]:
        return {"settings": planner.settings.as_dict(),
                "decisions": [d.as_dict() for d in planner.decisions]}

    @app.put(f"{PREFIX}/planner")
    async def planner_set(request: Request) -> dict[str, Any]:
        try:
            planner.update(await _json(request))
        except InvalidSetting as exc:
            raise APIError(f"invalid planner setting {exc}", exc.field,
                           code="invalid_setting") from None
        return {"settings": planner.settings.as_dict()}


def _role(role: object) -> int:
    if role not in _ROLES:
        raise APIError(f"role must be prefill or decode, got {role!r}", "role")
    return _ROLES[role]


def _positive(value: float, name: str) -> float:
    if not 0 < value <= TIMEOUTS.generate_s:
        raise APIError(f"{name} must be above 0 and at most {TIMEOUTS.generate_s:g}", name)
    return float(value)


def _waiting(node: NodeClient) -> int:
    """Requests queued on the node. A prefill node's also counts this router's requests
    it has not begun (they wait for its engine loop between two steps, where its Stats
    do not see them yet); a decode node's leaves out the reserved ones, which wait on a
    prefill."""
    s = node.stats
    if s is None:
        return 0
    if node.role == pb.PREFILL:
        return max(s.num_waiting, node.in_flight - s.num_running)
    return s.num_waiting


def _kv_usage(s: pb.StatsReply | None) -> float:
    return 1.0 - s.kv_blocks_free / s.kv_blocks_total if s and s.kv_blocks_total else 0.0


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise APIError("the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    return body


def _node_error(node: NodeClient, exc: grpc.aio.AioRpcError) -> APIError:
    return APIError(f"{node.name} failed: {exc.details()}", status=502, kind="server_error",
                    code="node_error")

