"""The chart's commands are the real ones: the router, prefill and decode containers of
the gpu-1p1d example, as rendered, run as local processes and answer a chat exactly as
the offline engine does.

Only these change: the device (cpu), the dtype (float32) and the model (the SmolLM2 GGUF,
--load-format gguf); and what only Kubernetes provides: $(POD_IP) is 127.0.0.1, each
pod's ports are free local ones (service DNS names become 127.0.0.1 and those ports), the
Redis URL is a redis-server of the test's own, and the Secret's keys are values the test
picks. Each process gets the container's env, not the test runner's TANDEM_* variables.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from helm_helpers import container, flag_values, manifests, render, values
from redis_server import RedisServer, free_port
from serving_helpers import metric_samples, node_address, start, stop, wait_up

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

SECRETS = {"api-key": "helm-api-key", "admin-token": "helm-admin-token",
           "cluster-secret": "helm-cluster-secret"}
POD_IP = "127.0.0.1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


def _env(c: dict[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet would set it, with the test's pod IP and secrets."""
    env = {}
    for e in c["env"]:
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
        else:
            env[e["name"]] = SECRETS[source["secretKeyRef"]["key"]]
    return env


def _argv(c: dict[str, Any], env: dict[str, str], changes: dict[str, str]) -> list[str]:
    """The container's args, $(VAR) expanded as the kubelet does, each flag of `changes`
    (given exactly once in the manifest) set to its new value."""
    assert "command" not in c  # the image's entrypoint, `tandem`, runs the args
    args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in c["args"]]
    for flag, value in changes.items():
        [i] = [i for i, a in enumerate(args) if a == flag]
        args[i + 1] = value
    return args


def _start(argv: list[str], env: dict[str, str], mp: pytest.MonkeyPatch) -> subprocess.Popen:
    """`tandem <argv>` (serving_helpers.start) with the container's env in place of the
    runner's TANDEM_* variables."""
    with mp.context() as m:
        for name in [n for n in os.environ if n.startswith("TANDEM_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        return start(argv)


def test_the_rendered_commands_serve_like_the_offline_engine(
        smollm2_path: Path, offline: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = manifests(render(values("gpu-1p1d")))
    router = container(docs, "Deployment", "tandem-router")
    pods = {pool: container(docs, "StatefulSet", f"tandem-{pool}")
            for pool in ("prefill", "decode")}
    model = {"--model": str(smollm2_path), "--load-format": "gguf"}
    procs: list[subprocess.Popen] = []
    with RedisServer() as redis:
        try:
            # The nodes take free ports (0) as they bind: ports picked ahead of them could
            # be taken meanwhile (a connection's ephemeral port).
            for c in pods.values():
                env = _env(c)
                procs.append(_start(_argv(c, env, {
                    **model, "--device": "cpu", "--dtype": "float32", "--port": "0",
                    "--transfer-port": "0", "--index": redis.url}), env, monkeypatch))
            # Each node advertises $(POD_IP); the router reaches the pod names there.
            addresses = [node_address(p) for p in procs]
            assert [a.rsplit(":", 1)[0] for a in addresses] == [POD_IP, POD_IP]
            local = {f"tandem-{pool}-0.tandem-{pool}.default.svc.cluster.local:50051": address
                     for pool, address in zip(pods, addresses)}
            env = _env(router)
            [prefill], [decode] = (flag_values(router["args"], f"--{p}") for p in pods)
            port = free_port()
            procs.append(_start(_argv(router, env, {
                **model, "--port": str(port), "--prefill": local[prefill],
                "--decode": local[decode], "--index": redis.url}), env, monkeypatch))
            url = f"http://127.0.0.1:{port}"
            wait_up(url, procs[2], every_node=True)

            [served] = flag_values(router["args"], "--served-model-name")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=SECRETS["api-key"],
                                   max_retries=0, timeout=60)
            got = client.chat.completions.create(model=served, messages=QUESTION,
                                                 max_tokens=MAX_TOKENS, temperature=0)
            want = offline.chat(QUESTION, SamplingParams(temperature=0.0,
                                                         max_tokens=MAX_TOKENS))[0]
            assert got.choices[0].message.content == want.text
            # The API key from the Secret is in force.
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0
                              ).models.list()
            assert _prefill_tokens(url, f"prefill@{local[prefill]}") > 0
        finally:
            stop(procs)


def _prefill_tokens(url: str, node: str, timeout_s: float = 10.0) -> float:
    """The node's tandem:node_prompt_tokens_computed from the router's /metrics, once the
    router's next poll (every second) has it above 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = sum(v for name, labels, v in metric_samples(url)
                    if name == "tandem:node_prompt_tokens_computed_total"
                    and labels["node"] == node)
        if value > 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.2)
