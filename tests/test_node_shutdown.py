"""A node stopped with SIGTERM (a pod's termination, a scale-down) drains: it takes no new
request, the stream it runs finishes whole, it exits once idle, and new requests go to
the other node meanwhile. Real `tandem node` and `tandem router` processes, SmolLM2."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from serving_helpers import cluster
from test_operator import ENGINE, ROUTER, Outcome, _complete, _want

from tandem import LLM, SamplingParams
from tandem.node import auth
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SECRET = "shutdown-secret"
LONG = 64  # tokens of the stream that runs through the drain (~4 s on 2 cores)


def _node(address: str) -> tuple[pb.HealthReply, pb.StatsReply]:
    with auth.authenticated(grpc.insecure_channel(address), SECRET.encode()) as channel:
        stub = pb_grpc.NodeStub(channel)
        return (stub.Health(pb.HealthRequest(), timeout=10),
                stub.Stats(pb.StatsRequest(), timeout=10))


def test_sigterm_drains_the_node_and_loses_no_request(offline: LLM) -> None:
    prompt, other = "The three primary colours are", "A haiku about the sea:"
    with cluster(0, 2, SECRET, [*ENGINE, "--drain-timeout", "60"],
                 router_flags=ROUTER) as c:
        running, first = Outcome(), threading.Event()
        stream = threading.Thread(target=_complete, args=(c.url, prompt, running, first, LONG))
        stream.start()
        assert first.wait(60), running.error
        busy = next(p for p in c.decode if _node(c.addresses[p.pid])[1].num_running == 1)
        address = c.addresses[busy.pid]
        busy.send_signal(signal.SIGTERM)  # the node process itself, as a kubelet would
        time.sleep(0.5)
        health, stats = _node(address)
        assert not health.accepting and stats.num_running == 1  # draining, still streaming

        during = Outcome()
        _complete(c.url, other, during)  # goes to the other node
        stream.join(timeout=120)
        assert busy.wait(timeout=30) == 0  # exits by itself once its stream ended
        assert running.error is None and during.error is None, (running.error, during.error)
        long = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
        assert running.text == offline.generate(prompt, long)[0].text
        assert during.text == _want(offline, [other])[0]
