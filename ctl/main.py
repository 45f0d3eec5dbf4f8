"""`tandem ctl`: operate a running cluster through the router's admin API
(notes/admin_api.md): read the nodes and the planner, add, drain and remove nodes, switch
their roles, rebalance the pools."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from tandem.ctl.client import WAIT_MARGIN_S, AdminClient, Json, RouterError, Unreachable

ROUTER_ENV, ADMIN_TOKEN_ENV = "TANDEM_ROUTER", "TANDEM_ADMIN_TOKEN"
DEFAULT_ROUTER = "http://127.0.0.1:8000"
ROLES = ("prefill", "decode")
OK, ROUTER_SAID_NO, USAGE, UNREACHABLE, REFUSED = 0, 1, 2, 3, 4

EPILOG = """\
exit codes:
  0  done
  1  the router answered with an error: tandem ctl: error: <message> (<code>)
  2  bad usage, or a rebalance target the up nodes cannot take
  3  the router could not be reached (refused, unknown host, timeout); the message
     names the URL
  4  the router refused the admin token (401, or 403: its admin API is closed)

The common flags come before the verb:
  tandem ctl --router http://10.0.0.5:8000 --admin-token-file ~/.tandem-admin status
"""

NODE_HEADER = ["node", "role", "state", "running", "waiting", "KV %", "prompt tok/s",
               "gen tok/s", "TTFT p90 ms", "ITL p90 ms", "in-flight"]
DECISION_HEADER = ["time", "mode", "action", "node", "from", "to", "outcome", "reason"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    ctl = sub.add_parser(
        "ctl", help="operate a running cluster through the router's admin API",
        description="Read and change a running cluster through its router's admin API\n"
                    "(/admin/v1): nodes, their roles and load, and the planner.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ctl.add_argument("--router", type=_router_url,
                     default=os.environ.get(ROUTER_ENV, DEFAULT_ROUTER), metavar="URL",
                     help=f"the router's base URL (default: ${ROUTER_ENV}, else "
                          f"{DEFAULT_ROUTER})")
    ctl.add_argument("--admin-token", default=None, metavar="TOKEN",
                     help=f"the router's admin token, sent as Authorization: Bearer; else "
                          f"--admin-token-file, else ${ADMIN_TOKEN_ENV} (prefer those two: "
                          f"flags show in the process list)")
    ctl.add_argument("--admin-token-file", default=None, metavar="PATH",
                     help="read the admin token from this file")
    ctl.add_argument("--timeout", dest="http_timeout", type=_positive, default=90.0,
                     metavar="S",
                     help="seconds to wait for each answer from the router; calls that wait "
                          "on the router (set-role, rebalance, nodes remove) wait at least "
                          f"their own timeout plus {WAIT_MARGIN_S:g} s (default: %(default)g)")
    ctl.set_defaults(func=run)
    verbs = ctl.add_subparsers(dest="ctl_command", required=True, metavar="VERB")

    status = verbs.add_parser(
        "status", help="the nodes: role, state, load and latency",
        description="One row per node: its role (old->new while a role switch runs), "
                    "state, running and waiting requests, KV cache use, prompt and "
                    "generation tokens per second and TTFT and ITL p90 over the last "
                    "minute, and this router's requests in flight on it. A number the "
                    "router does not have shows as -.")
    _add_view_args(status)
    status.set_defaults(verb=_status)
    _add_node_verbs(verbs)
    _add_role_verbs(verbs)
    _add_planner_verbs(verbs)


def _add_node_verbs(verbs: argparse._SubParsersAction) -> None:
    nodes = verbs.add_parser("nodes", help="list, add and remove nodes",
                             description="List, add and remove the router's nodes.")
    node_verbs = nodes.add_subparsers(dest="nodes_command", required=True, metavar="VERB")
    listing = node_verbs.add_parser("list", help="the nodes (as `tandem ctl status`)",
                                    description="The nodes, as `tandem ctl status` shows them.")
    _add_view_args(listing)
    listing.set_defaults(verb=_status)
    add = node_verbs.add_parser(
        "add", help="add a running node to the router",
        description="Add a running node; the router asks its Health for its role and "
                    "sends it requests once it is up.")
    add.add_argument("address", type=_address, metavar="ADDRESS",
                     help="the node's gRPC address, HOST:PORT")
    add.add_argument("--role", choices=ROLES, default=None,
                     help="the role the node must have: the router refuses the node if it "
                          "serves the other one (default: take the node's own)")
    add.set_defaults(verb=_add)
    remove = node_verbs.add_parser(
        "remove", help="drain a node, then remove it from the router",
        description="Stop sending the node new requests, wait for its running ones to "
                    "finish, then forget it. The node process keeps running. The last up "
                    "node of a pool cannot be removed.")
    remove.add_argument("address", type=_address, metavar="ADDRESS",
                        help="the node's gRPC address, HOST:PORT")
    remove.add_argument("--force", action="store_true",
                        help="remove it at once, without draining: its running requests fail")
    remove.add_argument("--drain-timeout", type=_positive, default=60.0, metavar="S",
                        help="give up if it is still busy after S seconds; it is undrained "
                             "again and nothing is removed (default: %(default)g)")
    remove.set_defaults(verb=_remove)

    drain = verbs.add_parser(
        "drain", help="send a node no new requests",
        description="New requests go to the node's pool peers; running ones finish. "
                    "Returns at once. The last up node of a pool cannot be drained.")
    drain.add_argument("address", type=_address, metavar="ADDRESS",
                       help="the node's gRPC address, HOST:PORT")
    drain.set_defaults(verb=_drain)
    undrain = verbs.add_parser("undrain", help="send a drained node requests again",
                               description="Undo drain: the node takes new requests again.")
    undrain.add_argument("address", type=_address, metavar="ADDRESS",
                         help="the node's gRPC address, HOST:PORT")
    undrain.set_defaults(verb=_undrain)


def _add_role_verbs(verbs: argparse._SubParsersAction) -> None:
    set_role = verbs.add_parser(
        "set-role", help="switch a node to the other role, in place",
        description="Drain the node, flip its role without reloading weights, and return "
                    "once it serves in the other pool. Refused if its pool would be left "
                    "empty.")
    set_role.add_argument("address", type=_address, metavar="ADDRESS",
                          help="the node's gRPC address, HOST:PORT")
    set_role.add_argument("role", choices=ROLES, help="the role it should serve")
    _add_switch_timeout(set_role)
    set_role.set_defaults(verb=_set_role)

    rebalance = verbs.add_parser(
        "rebalance", help="switch roles until the up nodes are N prefill : M decode",
        description="Plan the role switches that take the up nodes to N prefill : M "
                    "decode, moving the least-loaded nodes (fewest running + waiting) of "
                    "the pool that is too large, print the plan, and carry it out one "
                    "switch at a time, stopping at the first failure. N + M must be the "
                    "number of up nodes, each at least 1.")
    rebalance.add_argument("--prefill", type=int, required=True, metavar="N",
                           help="prefill nodes wanted")
    rebalance.add_argument("--decode", type=int, required=True, metavar="M",
                           help="decode nodes wanted")
    _add_switch_timeout(rebalance)
    rebalance.add_argument("--dry-run", action="store_true",
                           help="print the plan, switch nothing")
    rebalance.set_defaults(verb=_rebalance)


def _add_planner_verbs(verbs: argparse._SubParsersAction) -> None:
    planner = verbs.add_parser("planner", help="show and set the role planner",
                               description="The planner that switches node roles on its own.")
    planner_verbs = planner.add_subparsers(dest="planner_command", required=True,
                                           metavar="VERB")
    show = planner_verbs.add_parser("show", help="its settings and last decisions",
                                    description="The planner's settings and its last "
                                                "decisions, oldest first.")
    show.add_argument("--json", action="store_true",
                      help="print the router's JSON answer as is (every decision it keeps)")
    show.add_argument("--last", type=int, default=10, metavar="K",
                      help="show the last K decisions (default: %(default)s)")
    show.set_defaults(verb=_planner_show)
    put = planner_verbs.add_parser(
        "set", help="change some settings",
        description="Change the named settings, leaving the others. Values true and false "
                    "are booleans, numbers are numbers, anything else is text.",
        epilog="example: tandem ctl planner set ttft_target_ms=400 cooldown_s=60")
    put.add_argument("settings", type=parse_setting, nargs="+", metavar="KEY=VALUE",
                     help="a setting and its new value, as `planner show` names them")
    put.set_defaults(verb=_planner_set)
    enable = planner_verbs.add_parser("enable", help="turn the planner on",
                                      description="Turn the planner on.")
    enable.add_argument("--mode", choices=["slo", "load"], default="slo",
                        help="slo: keep TTFT and ITL p90 under their targets; load: balance "
                             "the pools' load (default: %(default)s)")
    enable.add_argument("--advisory", action="store_true",
                        help="log decisions only, switch nothing (default: act on them)")
    enable.set_defaults(verb=_planner_enable)
    disable = planner_verbs.add_parser("disable", help="turn the planner off",
                                       description="Turn the planner off (mode off).")
    disable.set_defaults(verb=_planner_disable)


def _add_view_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the router's JSON answer as is")
    p.add_argument("--watch", nargs="?", type=_positive, const=2.0, default=None, metavar="S",
                   help="redraw every S seconds (default S: 2) until Ctrl-C; with --json, "
                        "one JSON line each time; a router that does not answer is "
                        "reported and asked again")


def _add_switch_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", dest="switch_timeout", type=_positive, default=60.0,
                   metavar="S",
                   help="how long the router waits for the node to drain before giving up "
                        "on a switch, leaving its role unchanged (default: %(default)g)")


def run(args: argparse.Namespace) -> int:
    """Carry out the parsed `tandem ctl` verb; the exit code (see EPILOG)."""
    from tandem.node.auth import read_secret

    try:
        token = read_secret(args.admin_token, args.admin_token_file, ADMIN_TOKEN_ENV)
    except ValueError as exc:
        return _fail(str(exc), USAGE)
    client = AdminClient(args.router, token, args.http_timeout)
    try:
        return args.verb(client, args)
    except (RouterError, Unreachable) as exc:
        return _report(exc, client)


def plan_rebalance(nodes: list[Json], prefill: int, decode: int) -> list[tuple[str, str]]:
    """The role switches `(address, new role)`, in order, that take the up nodes to
    `prefill` : `decode`. Only the pool that is too large gives nodes, its least loaded
    first (fewest running + waiting), so it shrinks to its target, never below, and the
    other only grows: no pool is empty after any step. ValueError for a target the up
    nodes cannot take, before anything is planned."""
    up = [n for n in nodes if n.get("state") == "up"]
    if prefill < 1 or decode < 1:
        raise ValueError(f"each pool needs one node at least, not {prefill} prefill : "
                         f"{decode} decode")
    if prefill + decode != len(up):
        others = ", ".join(f"{n['address']} {n.get('state')}" for n in nodes
                           if n.get("state") != "up")
        raise ValueError(f"{prefill} prefill + {decode} decode is {prefill + decode} "
                         f"nodes, but {len(up)} are up" + (f" ({others})" if others else ""))
    for n in up:
        if n.get("switching_to") is not None:
            raise ValueError(f"{n['address']} is switching to {n['switching_to']}; "
                             f"rebalance once it is done")
        if n.get("role") not in ROLES:
            raise ValueError(f"{n['address']} has no known role yet; try again shortly")
    want = {"prefill": prefill, "decode": decode}
    giver = "decode" if sum(n["role"] == "prefill" for n in up) < prefill else "prefill"
    taker = "prefill" if giver == "decode" else "decode"
    pool = sorted((n for n in up if n["role"] == giver), key=lambda n: (_busy(n), n["address"]))
    return [(n["address"], taker) for n in pool[:len(pool) - want[giver]]]


def parse_setting(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` as the planner's JSON wants it: true/false as booleans, finite numbers
    as int or float, anything else as text."""
    key, sep, raw = (part.strip() for part in text.partition("="))
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for number in (int, float):
        try:
            value = number(raw)
        except ValueError:
            continue
        if math.isfinite(value):
            return key, value
    return key, raw


def nodes_table(nodes: list[Json]) -> str:
    """The status table: one row per node, `-` for what the router does not have."""
    return table(NODE_HEADER, [_node_row(n) for n in nodes], left=3)


def _node_row(node: Json) -> list[str]:
    load = node.get("load")
    return [_text(node.get("address")), _role(node), _text(node.get("state")),
            _num(_dig(load, "running"), ".0f"), _num(_dig(load, "waiting"), ".0f"),
            _num(_percent(_dig(load, "kv_usage")), ".1f"),
            _num(_dig(load, "prompt_tokens_per_s"), ".1f"),
            _num(_dig(load, "generation_tokens_per_s"), ".1f"),
            _num(_dig(load, "ttft_ms", "p90"), ".0f"), _num(_dig(load, "itl_ms", "p90"), ".1f"),
            _num(node.get("in_flight"), ".0f")]


def decisions_table(decisions: list[Json]) -> str:
    rows = [[_time(d.get("time")), _text(d.get("mode")), _text(d.get("action")),
             _text(d.get("node")), _text(d.get("from")), _text(d.get("to")),
             _text(d.get("outcome")), _text(d.get("reason"))] for d in decisions]
    return table(DECISION_HEADER, rows, left=len(DECISION_HEADER))


def table(header: list[str], rows: list[list[str]], left: int) -> str:
    """Columns two spaces apart, each as wide as its widest cell; the first `left`
    columns aligned left, the rest (numbers) right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
             for line in [header, *rows]]
    return "\n".join(lines)


def _status(client: AdminClient, args: argparse.Namespace) -> int:
    if args.watch is not None:
        return _watch(client, args)
    answer = client.nodes()
    print(json.dumps(answer, indent=2) if args.json else nodes_table(answer["nodes"]))
    return OK


def _watch(client: AdminClient, args: argparse.Namespace) -> int:
    """Redraw until Ctrl-C. A router that does not answer (restarting, say) is reported
    and asked again; any other failure ends the watch."""
    clear = sys.stdout.isatty() and not args.json
    try:
        while True:
            try:
                answer, error = client.nodes(), None
            except Unreachable as exc:
                answer, error = None, f"tandem ctl: {exc}"
            if clear:
                print("\x1b[H\x1b[2J", end="")
            if not args.json:
                print(f"{client.router}  every {args.watch:g} s  {time.strftime('%H:%M:%S')}")
            if answer is not None:
                print(json.dumps(answer) if args.json else nodes_table(answer["nodes"]))
            if error is not None:
                print(error, file=sys.stderr)
            if not (clear or args.json):
                print()
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return OK


def _add(client: AdminClient, args: argparse.Namespace) -> int:
    node = client.add_node(args.address, args.role)["node"]
    print(f"added {args.address} ({_role(node)}, {_text(node.get('state'))})")
    return OK


def _remove(client: AdminClient, args: argparse.Namespace) -> int:
    node = client.remove_node(args.address, args.force, args.drain_timeout)["node"]
    how = "at once, without draining" if args.force else "once drained"
    print(f"removed {args.address} ({_role(node)}) {how}")
    return OK


def _drain(client: AdminClient, args: argparse.Namespace) -> int:
    node = client.drain(args.address)["node"]
    print(f"drained {args.address} ({_role(node)}): new requests go elsewhere, running "
          f"ones finish")
    return OK


def _undrain(client: AdminClient, args: argparse.Namespace) -> int:
    node = client.undrain(args.address)["node"]
    print(f"undrained {args.address} ({_role(node)}): it takes new requests again")
    return OK


def _set_role(client: AdminClient, args: argparse.Namespace) -> int:
    node = client.set_role(args.address, args.role, args.switch_timeout)["node"]
    print(f"switched {args.address} to {_role(node)}")
    return OK


def _rebalance(client: AdminClient, args: argparse.Namespace) -> int:
    try:
        steps = plan_rebalance(client.nodes()["nodes"], args.prefill, args.decode)
    except ValueError as exc:
        return _fail(str(exc), USAGE)
    target = f"{args.prefill} prefill : {args.decode} decode"
    if not steps:
        print(f"already {target}: nothing to switch")
        return OK
    print(f"to reach {target}, one node at a time:")
    for i, (address, role) in enumerate(steps, 1):
        print(f"  {i}. {address} -> {role}")
    if args.dry_run:
        print("dry run: nothing switched")
        return OK
    for i, (address, role) in enumerate(steps, 1):
        print(f"{i}/{len(steps)}: switching {address} to {role} ...", flush=True)
        try:
            client.set_role(address, role, args.switch_timeout)
        except (RouterError, Unreachable) as exc:
            code = _report(exc, client)
            print(f"tandem ctl: stopped; {i - 1} of {len(steps)} steps done",
                  file=sys.stderr)
            return code
        print(f"switched {address} to {role}")
    return OK


def _planner_show(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.planner()
    if args.json:
        print(json.dumps(answer, indent=2))
        return OK
    settings, decisions = answer["settings"], answer["decisions"]
    print(table(["setting", "value"], [[k, _value(v)] for k, v in settings.items()], left=2))
    shown = decisions[-args.last:] if args.last > 0 else []
    if not decisions:
        print("\nno decisions yet")
    elif shown:
        print(f"\nthe last {len(shown)} of {len(decisions)} decisions:")
        print(decisions_table(shown))
    return OK


def _planner_set(client: AdminClient, args: argparse.Namespace) -> int:
    settings = client.set_planner(dict(args.settings))["settings"]
    print("planner: " + " ".join(f"{k}={_value(v)}" for k, v in settings.items()))
    return OK


def _planner_enable(client: AdminClient, args: argparse.Namespace) -> int:
    settings = client.set_planner({"mode": args.mode, "advisory": args.advisory})["settings"]
    how = ("advisory: it logs decisions, switches nothing" if settings.get("advisory")
           else "it switches roles on its own")
    print(f"planner on, {settings.get('mode')} mode: {how}")
    return OK


def _planner_disable(client: AdminClient, args: argparse.Namespace) -> int:
    client.set_planner({"mode": "off"})
    print("planner off: it switches no roles")
    return OK


def _report(exc: RouterError | Unreachable, client: AdminClient) -> int:
    if isinstance(exc, Unreachable):
        return _fail(str(exc), UNREACHABLE)
    message = exc.message
    if exc.status == 401 and client.token is None:
        message = (f"no admin token given: pass --admin-token-file PATH or set "
                   f"{ADMIN_TOKEN_ENV}")
    print(f"tandem ctl: error: {message} ({exc.code or f'HTTP {exc.status}'})",
          file=sys.stderr)
    return REFUSED if exc.status in (401, 403) else ROUTER_SAID_NO


def _fail(message: str, code: int) -> int:
    print(f"tandem ctl: error: {message}", file=sys.stderr)
    return code


def _busy(node: Json) -> float:
    load = node.get("load") or {}
    return (load.get("running") or 0) + (load.get("waiting") or 0)


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _role(node: Json) -> str:
    role, new = _text(node.get("role")), node.get("switching_to")
    return role if new is None else f"{role}->{new}"


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _num(value: Any, spec: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return format(value, spec)


def _percent(share: Any) -> Any:
    return share * 100 if isinstance(share, int | float) else None


def _time(t: Any) -> str:
    if isinstance(t, bool) or not isinstance(t, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _value(v: Any) -> str:
    """A setting as `planner set` takes it back."""
    return v if isinstance(v, str) else json.dumps(v)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a node's gRPC address HOST:PORT, got "
                                         f"{text!r}")
    return text


def _router_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT or https://..., got "
                                         f"{text!r}")
    return text.rstrip("/")
