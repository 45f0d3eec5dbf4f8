"""The compose stack for real: deploy/build.sh builds the CPU image with podman (against a
base image made locally when no registry answers), podman-compose brings up Redis, a
prefill node, a decode node and the router, a chat request through the published port
gets the offline engine's greedy answer, the prefill node computed the prompt, a killed
decode container is reported down, and `down` leaves no container or network behind.

Marked `deploy` (`make test-deploy`): the first build takes minutes. Without podman and
without the rights to install it, skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import deploy_build
import pytest
from openai import OpenAI
from redis_server import free_port
from serving_helpers import metric_samples

from tandem import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = [sys.executable, "-m", "podman_compose"]
API_KEY, ADMIN, SECRET = "deploy-test-key", "deploy-test-admin", "deploy-test-secret"

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(not deploy_build.can_build(), reason="no podman, and no root to install it"),
]


def _run(args: list[str], timeout: float, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, f"{' '.join(args)}: exit {out.returncode}\n{out.stdout[-3000:]}" \
                                f"\n{out.stderr[-3000:]}"
    return out


def _images_present(*names: str) -> str:
    """The first of `names` podman holds."""
    for name in names:
        if subprocess.run(["podman", "image", "exists", name]).returncode == 0:
            return name
    raise AssertionError(f"none of {names} was built")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The stack up under a project name of its own; yields (router URL, project)."""
    deploy_build.wait(timeout_s=1500)  # started when this test was collected
    redis_image = _images_present("docker.io/library/redis:7-alpine",
                                  "localhost/tandem-redis:7")
    port, project = free_port(), f"tandem-test-{os.getpid()}"
    env_file = tmp_path_factory.mktemp("deploy") / "test.env"
    settings = {"TANDEM_API_KEY": API_KEY, "TANDEM_ADMIN_TOKEN": ADMIN,
                "TANDEM_CLUSTER_SECRET": SECRET, "TANDEM_BIND": "127.0.0.1",
                "TANDEM_PORT": str(port), "TANDEM_REDIS_IMAGE": redis_image}
    env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    compose = [*COMPOSE, "-p", project, "-f", "deploy/compose.yaml", "--env-file", str(env_file)]
    try:
        _run([*compose, "up", "-d"], timeout=300)
        yield f"http://127.0.0.1:{port}", project
    finally:
        _run([*compose, "down", "-t", "10"], timeout=300)
        left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter",
                               f"label=io.podman.compose.project={project}"],
                              capture_output=True, text=True).stdout.split()
        networks = subprocess.run(["podman", "network", "ls", "--format", "{{.Name}}"],
                                  capture_output=True, text=True).stdout.split()
        assert left == [], f"containers left behind: {left}"
        assert not [n for n in networks if n.startswith(project)], networks


def _health(url: str) -> dict:
    """The router's /health, 200 or 503, with each node's up/down under its name."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def _by_address(named: dict[str, float | bool]) -> dict[str, float | bool]:
    """Keyed by address: the router names nodes ROLE@HOST:PORT."""
    return {name.split("@", 1)[1]: v for name, v in named.items()}


def _until(check, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(1)


def test_the_compose_stack_serves_and_reports_a_dead_decode_node(
        stack: tuple[str, str], offline: LLM) -> None:
    url, project = stack
    _until(lambda: _health(url)["status"] == "ok" and all(_health(url)["nodes"].values())
           and len(_health(url)["nodes"]) == 2, 300, "the router and both nodes are up")

    question = [{"role": "user", "content": "What is the capital of France?"}]
    want = offline.chat(question, SamplingParams(temperature=0.0, max_tokens=24))[0].text
    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    got = client.chat.completions.create(model="smollm2-135m-instruct", messages=question,
                                         temperature=0.0, max_tokens=24)
    assert got.choices[0].message.content == want

    def computed() -> dict[str, float | bool]:
        return _by_address({labels["node"]: v for name, labels, v in metric_samples(url)
                            if name == "tandem:node_prompt_tokens_computed_total"})

    # The router's node figures are its last poll of each node's Stats: a moment behind.
    _until(lambda: computed().get("prefill:50051", 0) >= got.usage.prompt_tokens, 15,
           f"the prefill node computed the prompt ({got.usage.prompt_tokens} tokens)")
    assert computed().get("decode:50051", 0) == 0, computed()

    subprocess.run(["podman", "kill", f"{project}_decode_1"], check=True,
                   capture_output=True)
    _until(lambda: _by_address(_health(url)["nodes"]).get("decode:50051") is False, 30,
           "the router reports the killed decode node down")
    up = _by_address({labels["node"]: v for name, labels, v in metric_samples(url)
                      if name == "tandem:node_up"})
    assert (up["prefill:50051"], up["decode:50051"]) == (1.0, 0.0), up
