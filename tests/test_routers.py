"""`tandem up --routers N`: N router processes on one port (SO_REUSEPORT), the kernel
spreading the connections among them; each serves with the same settings (the API key
too), and Ctrl-C stops them all."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from serving_helpers import tandem_up

KEY = "router-test-key"
STREAMS = 48
PROMPT = [5, 17, 99, 3, 250, 41]
TOKENS = 160


def _routers(up_pid: int) -> list[int]:
    """`tandem up` itself (the first router) and the routers it started."""
    others = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if parent == up_pid and b"router" in cmd and b"tandem.cli" in cmd:
            others.append(int(d.name))
    return [up_pid, *others]


def _connections(pid: int, port: int) -> int:
    """The established TCP connections to `port` that process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01" and inode in inodes:
                count += 1
    return count


def _completion(url: str, stream: bool) -> object:
    """The prompt's greedy completion, with the key, on a connection of its own."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    return urllib.request.urlopen(req, timeout=120)


def _open_stream(url: str) -> tuple[object, list[int]]:
    """A streamed completion, read up to its first token."""
    resp = _completion(url, stream=True)
    tokens: list[int] = []
    while not tokens:
        line = resp.readline()
        assert line, "the stream ended before its first token"
        if line.startswith(b"data: {"):
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    return resp, tokens


def _rest(resp: object, tokens: list[int]) -> list[int]:
    for line in resp:
        if line.startswith(b"data: {"):
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    resp.close()
    return tokens


def test_routers_share_the_port_serve_alike_and_stop_together() -> None:
    flags = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
             "--colocated", "1", "--routers", "2", "--api-key", KEY]
    with tandem_up(flags) as (url, proc, port):
        routers = _routers(proc.pid)
        assert len(routers) == 2, routers
        # Every router has the key: a request without it is refused, whichever answers.
        for _ in range(8):
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=30)
                raise AssertionError("a router served /v1/models without the API key")
            except urllib.error.HTTPError as exc:
                assert exc.code == 401
        want = _reference(url)
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            opened = list(pool.map(lambda _: _open_stream(url), range(STREAMS)))
            held = [_connections(pid, port) for pid in routers]
            done = list(pool.map(lambda o: _rest(*o), opened))
    assert all(n > 0 for n in held) and sum(held) == STREAMS, held
    assert all(tokens == want for tokens in done)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{routers[1]}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{routers[1]}").exists(), "the second router outlived tandem up"


def _reference(url: str) -> list[int]:
    """The prompt's greedy tokens, unstreamed."""
    with _completion(url, stream=False) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]
