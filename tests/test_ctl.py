"""`tandem ctl` without a router: the rebalance planner, the tables, KEY=VALUE parsing,
the arguments of every verb, and exit code 3 against a port where nothing listens."""

from __future__ import annotations

import argparse
import itertools
import socket
import time
from typing import Any

import pytest

from tandem.ctl.main import (
    DECISION_HEADER,
    NODE_HEADER,
    add_parser,
    decisions_table,
    nodes_table,
    parse_setting,
    plan_rebalance,
    run,
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def node(address: str, role: str | None, state: str = "up", running: int = 0,
         waiting: int = 0, switching_to: str | None = None) -> dict[str, Any]:
    return {"address": address, "role": role, "state": state, "switching_to": switching_to,
            "in_flight": 0, "load": {"running": running, "waiting": waiting}}


def cluster(roles: str, loads: list[int] | None = None) -> list[dict[str, Any]]:
    """Up nodes 127.0.0.1:5000, :5001, ... with roles from 'p'/'d' letters."""
    loads = loads or [0] * len(roles)
    return [node(f"127.0.0.1:{5000 + i}", {"p": "prefill", "d": "decode"}[r], running=load)
            for i, (r, load) in enumerate(zip(roles, loads))]


def replay(nodes: list[dict[str, Any]], steps: list[tuple[str, str]]) -> dict[str, int]:
    """Apply the steps one by one, checking each moves a distinct up node to the other
    role and leaves both pools non-empty; the final pool sizes."""
    roles = {n["address"]: n["role"] for n in nodes if n["state"] == "up"}
    moved = [address for address, _ in steps]
    assert len(set(moved)) == len(moved)
    for address, new_role in steps:
        assert roles[address] != new_role
        roles[address] = new_role
        pools = list(roles.values())
        assert pools.count("prefill") >= 1 and pools.count("decode") >= 1, steps
    return {role: list(roles.values()).count(role) for role in ("prefill", "decode")}


@pytest.mark.parametrize(("roles", "loads", "target", "steps"), [
    ("pd", None, (1, 1), []),
    ("ppdd", None, (2, 2), []),
    ("pddd", [0, 5, 1, 3], (2, 2), [("127.0.0.1:5002", "prefill")]),
    ("pddd", [0, 5, 1, 3], (3, 1), [("127.0.0.1:5002", "prefill"),
                                     ("127.0.0.1:5003", "prefill")]),
    ("pppd", [4, 0, 2, 9], (1, 3), [("127.0.0.1:5001", "decode"),
                                     ("127.0.0.1:5002", "decode")]),
    ("ppd", [3, 3, 0], (1, 2), [("127.0.0.1:5000", "decode")]),  # a tie: lower address
    ("dp", None, (1, 1), []),
])
def test_plan_moves_the_least_loaded_of_the_pool_too_large(
        roles: str, loads: list[int] | None, target: tuple[int, int],
        steps: list[tuple[str, str]]) -> None:
    nodes = cluster(roles, loads)
    assert plan_rebalance(nodes, *target) == steps
    assert replay(nodes, steps) == {"prefill": target[0], "decode": target[1]}


def test_plan_counts_running_and_waiting() -> None:
    nodes = [node("a:1", "prefill"), node("b:1", "decode", running=1, waiting=5),
             node("c:1", "decode", running=4, waiting=0)]
    assert plan_rebalance(nodes, 2, 1) == [("c:1", "prefill")]


def test_plan_ignores_nodes_that_are_not_up() -> None:
    nodes = [node("a:1", "prefill"), node("b:1", "decode", state="draining"),
             node("c:1", "decode", state="down"), node("d:1", "decode", running=7),
             node("e:1", "decode", running=1), node("f:1", None, state="down")]
    assert plan_rebalance(nodes, 2, 1) == [("e:1", "prefill")]


def test_plan_never_empties_a_pool_over_every_split_and_target() -> None:
    for size in range(2, 8):
        for roles in itertools.product("pd", repeat=size):
            loads = [(7 * i) % 5 for i in range(size)]
            nodes = cluster("".join(roles), loads)
            for prefill in range(1, size):
                steps = plan_rebalance(nodes, prefill, size - prefill)
                assert len(steps) == abs(roles.count("p") - prefill)
                assert replay(nodes, steps) == {"prefill": prefill, "decode": size - prefill}


def test_plan_fills_an_empty_pool_first_step() -> None:
    nodes = cluster("ddd", [2, 0, 1])
    steps = plan_rebalance(nodes, 2, 1)
    assert steps == [("127.0.0.1:5001", "prefill"), ("127.0.0.1:5002", "prefill")]
    assert replay(nodes, steps) == {"prefill": 2, "decode": 1}


@pytest.mark.parametrize(("nodes", "target", "message"), [
    (cluster("pd"), (2, 1), "2 prefill + 1 decode is 3 nodes, but 2 are up"),
    (cluster("ppdd"), (1, 2), "1 prefill + 2 decode is 3 nodes, but 4 are up"),
    (cluster("pd"), (2, 0), "each pool needs one node at least, not 2 prefill : 0 decode"),
    (cluster("pd"), (0, 2), "each pool needs one node at least, not 0 prefill : 2 decode"),
    (cluster("pd"), (-1, 3), "each pool needs one node at least, not -1 prefill : 3 decode"),
    ([], (1, 1), "1 prefill + 1 decode is 2 nodes, but 0 are up"),
    (cluster("pd") + [node("x:1", "decode", state="down")], (2, 1),
     "2 prefill + 1 decode is 3 nodes, but 2 are up (x:1 down)"),
    (cluster("pd") + [node("x:1", "decode", state="draining"), node("y:1", None, "down")],
     (1, 2), "1 prefill + 2 decode is 3 nodes, but 2 are up (x:1 draining, y:1 down)"),
    (cluster("pd") + [node("x:1", None)], (2, 1),
     "x:1 has no known role yet; try again shortly"),
    (cluster("pd") + [node("x:1", "decode", switching_to="prefill")], (2, 1),
     "x:1 is switching to prefill; rebalance once it is done"),
])
def test_plan_refuses_an_impossible_target(nodes: list[dict[str, Any]],
                                           target: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError) as error:
        plan_rebalance(nodes, *target)
    assert str(error.value) == message


def test_nodes_table() -> None:
    full = {"address": "127.0.0.1:50051", "role": "prefill", "state": "up",
            "switching_to": None, "pid": 12, "loaded_at": 1.0, "in_flight": 3,
            "load": {"running": 2, "waiting": 0, "reserved": 1, "kv_usage": 0.123,
                     "prompt_tokens_per_s": 512.34, "generation_tokens_per_s": 40.0,
                     "ttft_ms": {"p50": 120.0, "p90": 300.4, "p99": 410.0},
                     "itl_ms": {"p50": 20.0, "p90": 35.25, "p99": 60.0},
                     "requests_last_minute": 17}}
    switching = {"address": "10.0.0.2:7", "role": "decode", "state": "draining",
                 "switching_to": "prefill", "in_flight": 0,
                 "load": {"running": 11, "waiting": 4, "kv_usage": 0.5,
                          "prompt_tokens_per_s": 0.0, "generation_tokens_per_s": 1234.5,
                          "ttft_ms": None, "itl_ms": None}}
    unknown = {"address": "h:1", "role": None, "state": "down", "switching_to": None,
               "in_flight": 0, "load": None}
    assert nodes_table([full, switching, unknown]).splitlines() == [
        "node             role             state     running  waiting  KV %  prompt tok/s"
        "  gen tok/s  TTFT p90 ms  ITL p90 ms  in-flight",
        "127.0.0.1:50051  prefill          up              2        0  12.3         512.3"
        "       40.0          300        35.2          3",
        "10.0.0.2:7       decode->prefill  draining       11        4  50.0           0.0"
        "     1234.5            -           -          0",
        "h:1              -                down            -        -     -             -"
        "          -            -           -          0",
    ]


def test_nodes_table_without_nodes_is_its_header() -> None:
    assert nodes_table([]) == "  ".join(NODE_HEADER)


def test_decisions_table() -> None:
    t = 1764050000.0
    decisions = [{"time": t, "mode": "slo", "advisory": False, "action": "switch",
                  "node": "h:1", "from": "decode", "to": "prefill",
                  "reason": "TTFT p90 812 ms > 600 ms", "outcome": "done"},
                 {"time": None, "mode": "load", "action": "hold", "outcome": "advised"}]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    lines = decisions_table(decisions).splitlines()
    assert lines[0].split() == ["time", "mode", "action", "node", "from", "to", "outcome",
                                "reason"]
    assert len(DECISION_HEADER) == 8
    assert lines[1].split("  ")[0] == stamp
    assert lines[1].split()[2:] == ["slo", "switch", "h:1", "decode", "prefill", "done",
                                    "TTFT", "p90", "812", "ms", ">", "600", "ms"]
    assert lines[2].split() == ["-", "load", "hold", "-", "-", "-", "advised", "-"]


@pytest.mark.parametrize(("text", "pair"), [
    ("mode=slo", ("mode", "slo")),
    ("mode=off", ("mode", "off")),
    ("advisory=true", ("advisory", True)),
    ("advisory=False", ("advisory", False)),
    ("interval_s=5", ("interval_s", 5)),
    ("min_decode=-1", ("min_decode", -1)),
    ("hysteresis=0.2", ("hysteresis", 0.2)),
    ("ttft_target_ms=1e3", ("ttft_target_ms", 1000.0)),
    ("ttft_target_ms=nan", ("ttft_target_ms", "nan")),
    ("cooldown_s=inf", ("cooldown_s", "inf")),
    (" window_s = 30 ", ("window_s", 30)),
    ("a=b=c", ("a", "b=c")),
    ("mode=", ("mode", "")),
])
def test_parse_setting(text: str, pair: tuple[str, Any]) -> None:
    key, value = parse_setting(text)
    assert (key, value) == pair and type(value) is type(pair[1])


@pytest.mark.parametrize("text", ["mode", "=slo", " =1", ""])
def test_parse_setting_refuses_what_is_not_key_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
        parse_setting(text)


def test_planner_set_keeps_every_pair_in_order() -> None:
    args = parse(["ctl", "planner", "set", "mode=load", "advisory=true", "cooldown_s=45.5"])
    assert args.settings == [("mode", "load"), ("advisory", True), ("cooldown_s", 45.5)]


def test_common_flags_and_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_ROUTER", raising=False)
    args = parse(["ctl", "status"])
    assert (args.router, args.admin_token, args.admin_token_file, args.http_timeout) == (
        "http://127.0.0.1:8000", None, None, 90.0)
    assert args.func is run
    monkeypatch.setenv("TANDEM_ROUTER", "http://10.0.0.5:9000/")
    args = parse(["ctl", "status"])
    assert args.router == "http://10.0.0.5:9000"
    args = parse(["ctl", "--router", "https://r.example", "--admin-token", "t",
                  "--admin-token-file", "/tmp/t", "--timeout", "2.5", "status"])
    assert (args.router, args.admin_token, args.admin_token_file, args.http_timeout) == (
        "https://r.example", "t", "/tmp/t", 2.5)


@pytest.mark.parametrize(("argv", "expected"), [
    (["status"], {"json": False, "watch": None}),
    (["status", "--json"], {"json": True, "watch": None}),
    (["status", "--watch"], {"watch": 2.0}),
    (["status", "--watch", "0.5"], {"watch": 0.5}),
    (["nodes", "list", "--json"], {"json": True, "watch": None}),
    (["nodes", "list", "--watch", "3"], {"watch": 3.0}),
    (["nodes", "add", "127.0.0.1:5001"], {"address": "127.0.0.1:5001", "role": None}),
    (["nodes", "add", "[::1]:5001", "--role", "decode"],
     {"address": "[::1]:5001", "role": "decode"}),
    (["nodes", "remove", "h:1"], {"address": "h:1", "force": False, "drain_timeout": 60.0}),
    (["nodes", "remove", "h:1", "--force", "--drain-timeout", "5"],
     {"force": True, "drain_timeout": 5.0}),
    (["drain", "h:1"], {"address": "h:1"}),
    (["undrain", "h:1"], {"address": "h:1"}),
    (["set-role", "h:1", "prefill"], {"address": "h:1", "role": "prefill",
                                      "switch_timeout": 60.0, "http_timeout": 90.0}),
    (["set-role", "h:1", "decode", "--timeout", "120"],
     {"role": "decode", "switch_timeout": 120.0, "http_timeout": 90.0}),
    (["rebalance", "--prefill", "2", "--decode", "3"],
     {"prefill": 2, "decode": 3, "switch_timeout": 60.0, "dry_run": False}),
    (["rebalance", "--prefill", "1", "--decode", "1", "--timeout", "9", "--dry-run"],
     {"prefill": 1, "decode": 1, "switch_timeout": 9.0, "dry_run": True}),
    (["planner", "show"], {"json": False, "last": 10}),
    (["planner", "show", "--json", "--last", "3"], {"json": True, "last": 3}),
    (["planner", "enable"], {"mode": "slo", "advisory": False}),
    (["planner", "enable", "--mode", "load", "--advisory"], {"mode": "load", "advisory": True}),
    (["planner", "disable"], {}),
])
def test_verb_arguments(argv: list[str], expected: dict[str, Any]) -> None:
    args = parse(["ctl", *argv])
    assert {k: getattr(args, k) for k in expected} == expected
    assert callable(args.verb)


@pytest.mark.parametrize("argv", [
    [], ["nodes"], ["planner"], ["frobnicate"],
    ["drain"], ["drain", "localhost"], ["drain", "h:port"], ["drain", ":5001"],
    ["nodes", "add", "h:1", "--role", "both"], ["nodes", "remove", "h:1", "--drain-timeout", "0"],
    ["set-role", "h:1"], ["set-role", "h:1", "colocated"], ["set-role", "h:1", "decode",
                                                            "--timeout", "-1"],
    ["rebalance", "--prefill", "2"], ["rebalance", "--prefill", "x", "--decode", "1"],
    ["status", "--watch", "0"], ["status", "--watch", "nan"],
    ["planner", "set"], ["planner", "set", "mode"], ["planner", "enable", "--mode", "off"],
])
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["ctl", *argv])
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("router", ["127.0.0.1:8000", "ftp://h", "localhost"])
def test_a_router_url_needs_its_scheme(router: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["ctl", "--router", router, "status"])
    assert exit_.value.code == 2


@pytest.mark.parametrize(("verb", "flags"), [
    ([], ["--router", "--admin-token", "--admin-token-file", "--timeout", "status", "nodes",
          "drain", "undrain", "set-role", "rebalance", "planner", "exit codes",
          "0  done", "1  the router answered", "2  bad usage", "3  the router could not",
          "4  the router refused"]),
    (["status"], ["--json", "--watch"]),
    (["nodes"], ["list", "add", "remove"]),
    (["nodes", "list"], ["--json", "--watch"]),
    (["nodes", "add"], ["ADDRESS", "--role"]),
    (["nodes", "remove"], ["ADDRESS", "--force", "--drain-timeout"]),
    (["drain"], ["ADDRESS"]),
    (["undrain"], ["ADDRESS"]),
    (["set-role"], ["ADDRESS", "prefill", "decode", "--timeout"]),
    (["rebalance"], ["--prefill", "--decode", "--timeout", "--dry-run"]),
    (["planner"], ["show", "set", "enable", "disable"]),
    (["planner", "show"], ["--json", "--last"]),
    (["planner", "set"], ["KEY=VALUE"]),
    (["planner", "enable"], ["--mode", "--advisory"]),
    (["planner", "disable"], ["mode off"]),
])
def test_help_of_every_verb_names_its_flags(verb: list[str], flags: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["ctl", *verb, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in flags:
        assert flag in text, flag


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv", [
    ["status"], ["status", "--json"], ["nodes", "list"], ["nodes", "add", "127.0.0.1:5001"],
    ["nodes", "remove", "127.0.0.1:5001", "--force"], ["drain", "127.0.0.1:5001"],
    ["undrain", "127.0.0.1:5001"], ["set-role", "127.0.0.1:5001", "decode"],
    ["rebalance", "--prefill", "1", "--decode", "1", "--dry-run"],
    ["rebalance", "--prefill", "0", "--decode", "1"],
    ["planner", "show"], ["planner", "set", "mode=slo"], ["planner", "enable"],
    ["planner", "disable"],
])
def test_no_router_listening_exits_3(argv: list[str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    router = f"http://127.0.0.1:{free_port()}"
    code = run(parse(["ctl", "--router", router, "--admin-token", "t", *argv]))
    out, err = capsys.readouterr()
    assert code == 3
    assert err == f"tandem ctl: error: cannot reach the router at {router} " \
                  f"(Connection refused)\n"
    assert out == ""


def test_an_unreadable_token_file_is_bad_usage(tmp_path: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-token"
    code = run(parse(["ctl", "--router", f"http://127.0.0.1:{free_port()}",
                      "--admin-token-file", str(missing), "status"]))
    assert code == 2
    assert capsys.readouterr().err.startswith(
        f"tandem ctl: error: cannot read the secret file {missing}")
