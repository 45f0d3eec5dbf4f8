"""`tandem up`'s node plans (--prefill N --decode M, --colocated N, devices per role and
memory shares), and two real clusters of the tiny dummy model served as token ids
(--skip-tokenizer-init): colocated (one node that prefills and decodes) and 2P1D; both
give the offline engine's tokens."""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from serving_helpers import metric_samples, tandem_up

from tandem import LLM, SamplingParams
from tandem.cli import build_parser
from tandem.node.auth import CLUSTER_SECRET_ENV
from tandem.router.main import NodePlan, plan_nodes, share_cpu
from tandem.router.mps import share_gpu, shared_cuda

TINY = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init"]


def up_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *flags])


def test_default_plan_is_one_prefill_and_one_decode_node() -> None:
    assert plan_nodes(up_args()) == [NodePlan("prefill", "cpu", 0.85),
                                     NodePlan("decode", "cpu", 0.85)]


def test_decode_nodes_take_their_own_token_budget() -> None:
    """--decode-max-num-batched-tokens: the decode nodes' step budget; the prefill nodes
    keep --max-num-batched-tokens."""
    from tandem.router.main import _engine_flags

    args = up_args("--max-num-batched-tokens", "4096", "--decode-max-num-batched-tokens",
                   "512")
    budgets = {}
    for node in plan_nodes(args):
        flags = _engine_flags(args, node)
        budgets[node.role] = flags[flags.index("--max-num-batched-tokens") + 1]
    assert budgets == {"prefill": "4096", "decode": "512"}
    flags = _engine_flags(up_args(), plan_nodes(up_args())[1])
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "2048"


def test_devices_per_role_and_shared_devices_split_the_memory() -> None:
    plan = plan_nodes(up_args("--prefill", "2", "--decode", "1", "--prefill-devices",
                              "cuda:0,cuda:1", "--decode-devices", "cuda:1"))
    # A device with both roles: the prefill nodes take --prefill-share (0.3) of the
    # fraction, the decode nodes the rest; a device with one role is split evenly.
    assert [(n.role, n.device) for n in plan] == [
        ("prefill", "cuda:0"), ("prefill", "cuda:1"), ("decode", "cuda:1")]
    assert [n.memory_fraction for n in plan] == pytest.approx([0.85, 0.85 * 0.3, 0.85 * 0.7])
    plan = plan_nodes(up_args("--device", "cuda", "--gpu-memory-fraction", "0.8",
                              "--prefill-share", "0.25"))
    assert [n.memory_fraction for n in plan] == pytest.approx([0.2, 0.6])
    plan = plan_nodes(up_args("--device", "cuda", "--prefill", "2", "--decode", "2"))
    assert [n.memory_fraction for n in plan] == pytest.approx(
        [0.85 * 0.15, 0.85 * 0.15, 0.85 * 0.35, 0.85 * 0.35])
    with pytest.raises(ValueError, match="--prefill-share"):
        plan_nodes(up_args("--device", "cuda", "--prefill-share", "1"))


def test_cpu_nodes_sharing_the_cores_spin_briefly_unless_the_environment_says() -> None:
    env = {"PATH": "/bin"}
    share_cpu(env)
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000"}
    for given in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(given)
        share_cpu(env)
        assert env == given


def test_nodes_sharing_a_cuda_device_ask_for_mps_only_where_it_applies(tmp_path) -> None:  # noqa: ANN001
    assert shared_cuda(["cuda", "cuda:0", "cuda:1", "cpu", "cpu"]) == ["cuda:0"]
    assert shared_cuda(["cuda:0", "cuda:1"]) == [] and shared_cuda(["cpu", "cpu"]) == []
    no_daemon = {"PATH": str(tmp_path)}  # nvidia-cuda-mps-control is not there
    for devices, env, mode in ((["cuda", "cuda"], dict(no_daemon), "off"),
                               (["cuda:0", "cuda:1"], dict(no_daemon), "on"),
                               (["cuda", "cuda"], dict(no_daemon, CUDA_MPS_PIPE_DIRECTORY="/x"),
                                "on"),
                               (["cuda", "cuda"], dict(no_daemon), "auto")):
        before = dict(env)
        assert share_gpu(devices, env, mode) is None
        assert env == before
    with pytest.raises(RuntimeError, match="--mps on: nvidia-cuda-mps-control is not on PATH"):
        share_gpu(["cuda", "cuda"], dict(no_daemon), "on")


def test_mps_insisted_on_without_its_daemon_ends_tandem_up_with_a_clear_error(tmp_path) -> None:  # noqa: ANN001
    import subprocess
    import sys

    from serving_helpers import free_port

    env = dict(os.environ, PATH=f"{tmp_path}:{os.path.dirname(sys.executable)}")
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "up", *TINY, "--port",
                          str(free_port()), "--device", "cuda", "--mps", "on"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "tandem: error: --mps on: nvidia-cuda-mps-control is not on PATH (it comes with "
        "the NVIDIA driver)")


def test_a_node_that_cannot_start_ends_tandem_up_with_a_clear_error() -> None:
    """No traceback: the node's own error, then tandem up's one line, and exit code 1."""
    import subprocess
    import sys

    from serving_helpers import free_port

    out = subprocess.run([sys.executable, "-m", "tandem.cli", "up", *TINY, "--port",
                          str(free_port()), "--device", "cuda:7"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "tandem: error: the prefill node exited with code" in out.stderr
    assert "Traceback" not in out.stderr.split("tandem: error: the prefill node")[1]


def test_colocated_plan_has_decode_nodes_only() -> None:
    plan = plan_nodes(up_args("--colocated", "2", "--decode-devices", "cuda:0,cuda:1"))
    assert plan == [NodePlan("decode", "cuda:0", 0.85), NodePlan("decode", "cuda:1", 0.85)]


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill", "2", "--prefill-devices", "cuda:0,cuda:1,cuda:2"], "3 devices for 2"),
    (["--colocated", "1", "--prefill-devices", "cuda:0"], "no prefill nodes"),
    (["--decode", "0"], "at least 1"),
    (["--colocated", "0"], "at least 1"),
    (["--decode-max-num-batched-tokens", "0"], "1 or more"),
])
def test_inconsistent_plans_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_nodes(up_args(*flags))


# --- real clusters ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[["--colocated", "1"], ["--prefill", "2"],
                                        ["--connector", "nccl"]],
                ids=["colocated", "2P1D", "1P1D-nccl"])
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[str]]]:
    # With a cluster secret, as a deployment runs: nccl's hello must prove it too.
    os.environ[CLUSTER_SECRET_ENV] = "placement-secret"
    try:
        with tandem_up([*TINY, *request.param]) as (url, _, _):
            yield url, request.param
    finally:
        del os.environ[CLUSTER_SECRET_ENV]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", load_format="dummy")


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_token_ids_in_token_ids_out_equal_the_offline_engine(cluster, offline: LLM) -> None:  # noqa: ANN001
    url, flags = cluster
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        roles = sorted(name.split("@")[0] for name in json.loads(r.read())["nodes"])
    prefill = 0 if "--colocated" in flags else 2 if "--prefill" in flags else 1
    assert roles == ["decode"] + ["prefill"] * prefill
    prompts = [[5, 17, 99, 3, 250, 41, 7], list(range(100, 140))]
    for prompt in prompts:
        want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True))[0]
        status, got = _post(url, "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, got
        choice = got["choices"][0]
        assert choice["token_ids"] == want.token_ids and choice["text"] == ""
        assert got["usage"]["completion_tokens"] == 12
    local = sum(v for name, labels, v in metric_samples(url)
                if name == "tandem:router_requests_total" and labels.get("pool") == "decode-local")
    # Colocated: no prefill pool, the decode node computed every prompt; else none, and
    # their KV came over the connector (nccl: over gloo, its hello proving the secret).
    assert local == (len(prompts) if "--colocated" in flags else 0)
    def received() -> float:  # as of the router's last Stats poll of the decode node
        return sum(v for name, _, v in metric_samples(url)
                   if name == "tandem:kv_transfer_bytes_received_total")

    deadline = time.monotonic() + 10
    while prefill and not received() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (received() > 0) == (prefill > 0)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "some text"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "stop": ["x"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_text_without_a_tokenizer_is_a_400(cluster, path: str, body: dict, param: str) -> None:  # noqa: ANN001
    status, got = _post(cluster[0], path, {"model": "tiny", **body})
    assert status == 400 and got["error"]["param"] == param
    assert got["error"]["code"] == "tokenizer_skipped"
