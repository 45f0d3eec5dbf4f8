"""Prometheus metrics under the `tandem:` prefix: the request latencies vLLM users know
(same meanings and buckets), measured at the router per request; each node's load and
token counts, as its last poll read them (label `node`); the router's own counters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.router.index import RouterIndex
from tandem.router.pool import Pool

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RouterMetrics:
    def __init__(self, pool: Pool, index: RouterIndex) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("tandem:time_to_first_token_seconds",
                              "Time to first token: request received to first token sent.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds",
                             "Time between two consecutive output chunks of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds",
                             "Request received to last token sent.", buckets=E2E_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens of "
                                         "finished requests.", registry=r)
        self.requests = Counter("tandem:router_requests", "Requests by where their prompt was "
                                "computed: a prefill node, or the decode node itself.",
                                ["pool"], registry=r)
        self.retries = Counter("tandem:router_retries", "Retries, by the stage that failed.",
                               ["stage"], registry=r)
        self.transfer_failures = Counter("tandem:router_transfer_failures",
                                         "Prefill calls (compute and KV push) that failed.",
                                         registry=r)
        self.streams = Counter("tandem:router_streams", "Requests by how their tokens came "
                               "from the decode node: batched in its Outputs stream, or in "
                               "the request's own call.", ["path"], registry=r)
        self.early_prefills = Counter("tandem:router_early_prefills", "Prompts this router "
                                      "asked a prefill node to start while their decode node "
                                      "reserved blocks (the early start).", registry=r)
        self.prefill_overflows = Counter(
            "tandem:router_prefill_overflows", "Prompts this router had their decode node "
            "compute because the prefill node's queue would hold them longer than "
            "--prefill-overflow-ms.", registry=r)
        self.early_first_tokens = Counter(
            "tandem:router_early_first_tokens", "First tokens sent to the client from the "
            "early start's prefill node, ahead of the decode node's first chunk.", registry=r)
        self.errors = Counter("tandem:router_request_errors", "Requests that ended in an "
                              "error, by HTTP status.", ["status"], registry=r)
        self.planner_actions = Counter("tandem:planner_actions", "Role switches the planner "
                                       "made, by the pool left and the pool joined.",
                                       ["from", "to"], registry=r)
        self.queue_time = Histogram(
            "tandem:request_queue_time_seconds", "Time a request waited for resources: in "
            "the router's queue and in its decode node's queue for KV blocks.",
            buckets=E2E_BUCKETS, registry=r)
        self._nodes = _NodeCollector(pool)
        r.register(self._nodes)
        r.register(_IndexCollector(index))


    def watch_queue(self, queue: Queued) -> None:
        """`tandem:num_requests_waiting{node="router"}` counts `queue`'s waiters."""
        self._nodes.queue = queue


class Queued(Protocol):
    @property
    def num_waiting(self) -> int: ...


class _IndexCollector(Collector):
    def __init__(self, index: RouterIndex) -> None:
        self.index = index

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("tandem:router_index_lookups", "Prompts looked up in the "
                                  "block-hash index.", value=self.index.lookups)
        yield CounterMetricFamily("tandem:router_index_hit_blocks", "Blocks of looked-up "
                                  "prompts some node held (the best node's, per prompt).",
                                  value=self.index.hit_blocks)


class _NodeCollector(Collector):
    """Each node's figures from its last Stats poll."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.queue: Queued | None = None  # the router's own, labelled node="router"

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"tandem:{name}", doc, labels=["node"])

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(f"tandem:{name}", doc, labels=["node", *labels])

        families = {
            "num_requests_running": gauge("num_requests_running", "Requests in the batch."),
            "num_requests_waiting": gauge("num_requests_waiting", "Requests queued."),
            "kv_cache_usage_perc": gauge("kv_cache_usage_perc",
                                         "KV cache usage, 0 to 1 (1 is full)."),
            "kv_blocks_used": gauge("kv_blocks_used", "KV blocks held by requests."),
            "node_up": gauge("node_up", "1 while the node answers its health checks."),
            "router_outputs_stream_open": gauge(
                "router_outputs_stream_open", "Decode nodes: 1 while this router's Outputs "
                "stream there is open."),
            "node_prompt_tokens_computed": counter("node_prompt_tokens_computed",
                                                   "Prompt tokens the node computed."),
            "prefix_cache_queries": counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the node's prefix "
                                            "cache (of requests that ended)."),
            "prefix_cache_hits": counter("prefix_cache_hits",
                                         "Prompt tokens found in the node's prefix cache, by "
                                         "tier: device, host (copied back from the node's "
                                         "host tier), or peer (pulled from another node "
                                         "for the request).", labels=("tier",)),
            "kv_pulled_bytes": counter("kv_pulled_bytes", "KV bytes the node pulled from "
                                       "peers' prefix caches."),
            "kv_pulls_failed": counter("kv_pulls_failed", "Prefix pulls from peers that "
                                       "failed (the prompt was computed)."),
            "kv_host_usage": gauge("kv_host_usage",
                                   "The node's host KV tier in use, 0 to 1 (nodes with one)."),
            "num_preemptions": counter("num_preemptions",
                                       "Requests the node preempted (recompute)."),
            "kv_transfer_seconds": counter("kv_transfer_seconds",
                                           "Seconds the node's KV pushes took, summed."),
            "node_generation_tokens": counter("node_generation_tokens",
                                              "Tokens the node generated."),
            "kv_transfer_bytes_sent": counter("kv_transfer_bytes_sent",
                                              "KV bytes the node pushed to decode nodes."),
            "kv_transfer_bytes_received": counter("kv_transfer_bytes_received",
                                                  "KV bytes the node received."),
            "kv_transfer_failures": counter("kv_transfer_failures",
                                            "KV transfers that failed on the node."),
            "engine_steps": counter("engine_steps", "Engine steps the node ran, by how: "
                                    "decode_graph or prefill_graph (a CUDA graph replayed), "
                                    "or eager.", labels=("kind",)),
        }
        if self.queue is not None:
            families["num_requests_waiting"].add_metric(["router"], self.queue.num_waiting)
        for node in self.pool.nodes:
            label = [node.name]
            families["node_up"].add_metric(label, 1.0 if node.healthy else 0.0)
            if node in self.pool.decode:
                families["router_outputs_stream_open"].add_metric(
                    label, 1.0 if node.outputs_open else 0.0)
            s = node.stats
            if s is None or not node.reachable:  # gone: its last figures are stale
                continue
            used = s.kv_blocks_total - s.kv_blocks_free
            families["num_requests_running"].add_metric(label, s.num_running)
            families["num_requests_waiting"].add_metric(label, s.num_waiting + s.num_reserved)
            families["kv_cache_usage_perc"].add_metric(
                label, used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
            families["kv_blocks_used"].add_metric(label, used)
            families["node_prompt_tokens_computed"].add_metric(label, s.prompt_tokens_computed)
            families["prefix_cache_queries"].add_metric(label, s.prefix_cache_queries)
            host, peer = s.prompt_tokens_cached_host, s.prompt_tokens_cached_peer
            families["prefix_cache_hits"].add_metric([*label, "device"],
                                                     s.prompt_tokens_cached - host - peer)
            families["prefix_cache_hits"].add_metric([*label, "host"], host)
            families["prefix_cache_hits"].add_metric([*label, "peer"], peer)
            families["kv_pulled_bytes"].add_metric(label, s.kv_bytes_pulled)
            families["kv_pulls_failed"].add_metric(label, s.pulls_failed)
            if s.kv_host_blocks_total:
                families["kv_host_usage"].add_metric(
                    label, s.kv_host_blocks_used / s.kv_host_blocks_total)
            families["num_preemptions"].add_metric(label, s.num_preemptions)
            families["kv_transfer_seconds"].add_metric(label, s.kv_transfer_seconds)
            families["node_generation_tokens"].add_metric(label, s.generation_tokens)
            families["kv_transfer_bytes_sent"].add_metric(label, s.kv_bytes_sent)
            families["kv_transfer_bytes_received"].add_metric(label, s.kv_bytes_received)
            families["kv_transfer_failures"].add_metric(label, s.transfers_failed)
            for kind in ("decode_graph", "prefill_graph", "eager"):
                families["engine_steps"].add_metric([*label, kind], getattr(s, f"steps_{kind}"))
        yield from families.values()
