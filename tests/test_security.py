"""The doors of a running cluster (`tandem up`, real SmolLM2, 1P1D): the API key on every
route but /health, the admin token on /admin, the cluster secret on every node gRPC call
(the router's, and the decode node's own calls to the prefill node, which decode-first
makes on every request here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from serving_helpers import tandem_up

from tandem.node import auth
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc
from tandem.router.guard import Authenticate, Credentials

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
API_KEY, ADMIN_TOKEN, SECRET = "key-for-tests", "admin-for-tests", "cluster-for-tests"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    os.environ["TANDEM_API_KEY"] = API_KEY  # the environment, as an operator would
    os.environ[auth.CLUSTER_SECRET_ENV] = SECRET
    try:
        with tandem_up(["--admin-token", ADMIN_TOKEN, "--num-kv-blocks", "256",
                        "--max-model-len", "512"]) as (url, _, _):
            yield url
    finally:
        del os.environ["TANDEM_API_KEY"], os.environ[auth.CLUSTER_SECRET_ENV]


def _call(url: str, path: str, body: dict[str, Any] | None = None,
          token: str | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if path != "/metrics" else {}, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ROUTES = [("/v1/models", None), ("/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                     "max_tokens": 2}),
          ("/v1/chat/completions", CHAT), ("/no/such/route", None)]


@pytest.mark.parametrize("token", [None, "wrong-key", ADMIN_TOKEN])
@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_every_route_but_health_needs_the_api_key(url: str, path: str, body: Any,
                                                  token: str | None) -> None:
    status, answer, headers = _call(url, path, body, token)
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    error = answer["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert ("no API key" in error["message"]) == (token is None)


def test_health_and_metrics_stay_open_and_the_key_opens_the_rest(url: str) -> None:
    assert _call(url, "/health")[0] == 200
    assert _call(url, "/metrics")[0] == 200
    status, models, _ = _call(url, "/v1/models", token=API_KEY)
    assert status == 200 and models["data"][0]["id"] == MODEL
    status, answer, _ = _call(url, "/v1/chat/completions", CHAT, API_KEY)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert _call(url, "/no/such/route", token=API_KEY)[0] == 404


def test_admin_routes_take_the_admin_token_never_the_api_key(url: str) -> None:
    status, answer, _ = _call(url, "/admin/v1/nodes", token=API_KEY)
    assert status == 403 and answer["error"]["code"] == "api_key_not_admin"
    status, answer, _ = _call(url, "/admin/v1/nodes", token="not-the-admin-token")
    assert status == 401 and answer["error"]["code"] == "invalid_admin_token"
    status, answer, _ = _call(url, "/admin/v1/nodes", token=ADMIN_TOKEN)
    assert status == 200
    assert sorted(n["role"] for n in answer["nodes"]) == ["decode", "prefill"]
    assert all(n["state"] == "up" for n in answer["nodes"])


def test_tandem_ctl_status_lists_both_nodes_of_tandem_up_with_live_numbers(url: str) -> None:
    """The operator's first look at `tandem up`: both nodes, up, with the load of the
    requests just served (generated tokens/s, TTFT over the last minute)."""
    for _ in range(2):
        assert _call(url, "/v1/chat/completions", CHAT, API_KEY)[0] == 200
    # Rates come from the nodes' counters, read once a second (router/pool.py POLL_S):
    # the requests show once a read has come after them.
    time.sleep(1.5)
    env = {**os.environ, "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN}
    ctl = [sys.executable, "-m", "tandem.cli", "ctl", "--router", url, "status"]
    table = subprocess.run(ctl, env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and table.stdout.count(" up ") == 2, table.stdout
    listed = subprocess.run([*ctl, "--json"], env=env, capture_output=True, text=True,
                            timeout=60)
    nodes = {n["role"]: n for n in json.loads(listed.stdout)["nodes"]}
    assert sorted(nodes) == ["decode", "prefill"]
    assert nodes["decode"]["load"]["generation_tokens_per_s"] > 0
    assert nodes["prefill"]["load"]["prompt_tokens_per_s"] > 0
    assert 0 < nodes["decode"]["load"]["ttft_ms"]["p50"] < 60_000


def test_a_node_obeys_only_calls_with_the_cluster_secret(url: str) -> None:
    nodes = _call(url, "/admin/v1/nodes", token=ADMIN_TOKEN)[1]["nodes"]
    for node in nodes:
        for secret in (None, b"another-cluster"):
            with auth.authenticated(grpc.insecure_channel(node["address"]), secret) as ch:
                stub = pb_grpc.NodeStub(ch)
                for call in (lambda s: s.Health(pb.HealthRequest(), timeout=10),
                             lambda s: s.Abort(pb.AbortRequest(request_id="x"), timeout=10),
                             lambda s: s.SetRole(pb.SetRoleRequest(role=pb.PREFILL),
                                                 timeout=10),
                             lambda s: next(s.Outputs(pb.OutputsRequest(subscriber="s"),
                                                      timeout=10))):
                    with pytest.raises(grpc.RpcError) as caught:
                        call(stub)
                    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with auth.authenticated(grpc.insecure_channel(node["address"]), SECRET.encode()) as ch:
            health = pb_grpc.NodeStub(ch).Health(pb.HealthRequest(), timeout=10)
            assert pb.Role.Name(health.role).lower() == node["role"]


@pytest.mark.parametrize(("path", "given", "protect", "allowed"), [
    ("/health", None, True, True),
    ("/metrics", None, False, True),
    ("/metrics", None, True, False),
    ("/metrics", b"k", True, True),
    ("/v1/models", b"k", False, True),
    ("/v1/models", b"k2", False, False),
    ("/admin/v1/nodes", b"k", False, False),
])
def test_which_routes_the_api_key_guards(path: str, given: bytes | None, protect: bool,
                                         allowed: bool) -> None:
    guard = Authenticate(None, Credentials(api_key="k", admin_token="a",  # type: ignore[arg-type]
                                           protect_metrics=protect))
    assert (guard._check(path, given) is None) == allowed


def test_without_an_admin_token_the_admin_api_is_closed() -> None:
    guard = Authenticate(None, Credentials())  # type: ignore[arg-type]
    error = guard._check("/admin/v1/nodes", b"anything")
    assert error is not None and error.status == 403 and error.code == "admin_api_closed"
    assert guard._check("/v1/models", None) is None  # no API key: the API is open
