"""One engine: a model on a device, its paged KV cache, scheduler, runner and sampler.
`step()` is schedule → run → postprocess.

With async scheduling (the CUDA default) a step is launched before the previous one's
tokens are read: step() schedules and launches step N+1, then reads step N's tokens
and postprocesses them while the GPU computes N+1, so the host's work hides behind the
GPU's. A request keeps PENDING_TOKEN in place of its newest token until then; the
scheduler does not run a request past a length limit it may have reached, and a request
that turns out to have stopped at step N has its token of N+1 discarded. Steps whose
sampling needs the newest tokens on the host (penalties), reads logprobs, or pushes KV
layer by layer wait for the previous step first and run as before."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from tandem.engine import cpu_linear, cpu_ops, fp8
from tandem.engine.attention import make_backend
from tandem.engine.block_hash import root_hash
from tandem.engine.block_pool import BlockPool, EventHook
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import capture_graphs
from tandem.engine.host_tier import HostTier, block_bytes
from tandem.engine.kv_budget import num_kv_blocks
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.loader import (
    gguf_matrix_types,
    load_gguf_blocks,
    load_model_config,
    load_tokenizer,
    load_weights,
    resolve_model,
)
from tandem.engine.model_runner import ModelRunner, SampledTokens
from tandem.engine.models import model_class
from tandem.engine.ops import ops_for
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import PENDING_TOKEN, Request, RequestStatus
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger(__name__)


def _resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use 'cpu' or 'cuda'")
    return device


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. Triton launches, CUDA graph
    captures and argument-less `torch.cuda` calls go to the current device, which every
    new thread starts at 0; so each thread that runs a node's CUDA work binds first (a
    stream context, `torch.cuda.stream(s)`, binds its stream's device while it lasts)."""
    if device.type == "cuda" and device.index is not None:  # plain "cuda": the current one
        torch.cuda.set_device(device)


class KVCacheFull(RuntimeError):
    """The blocks a request needs are not free now (they may be later)."""


@dataclass(eq=False)
class _Launched:
    """A step launched ahead: its sampling requests and their tokens, not yet read."""

    requests: list[Request]
    tokens: SampledTokens
    prompt_tokens: int  # computed in the step
    began: float  # time.perf_counter() at its launch


class LLMEngine:
    def __init__(self, config: EngineConfig, on_block_event: EventHook | None = None) -> None:
        self.config = config
        src = resolve_model(config.model, config.load_format)
        self.model_name = src.name
        self.model_config = mc = load_model_config(src)
        self.device = device = _resolve_device(config.device)
        bind_thread(device)  # this thread captures graphs and may step the engine
        torch.manual_seed(config.seed)
        gguf_types = gguf_matrix_types(src)
        self.cpu_weights = cpu_linear.weights_mode(config.cpu_weights, device, config.dtype,
                                                   gguf_types)
        fused = cpu_ops.fused_for(self.cpu_weights)
        attention = make_backend(config.attention_backend, device, config.cache.block_size,
                                 mc.num_kv_heads, fused)
        self.attention_backend = attention.name
        # Built in its dtype: built in fp32 and cast, it held twice its bf16 weights at
        # once, and nodes loading side by side on one device ran out of memory.
        with torch.device(device), _default_dtype(config.dtype):
            ops = ops_for(attention.name, device, fused)
            model = model_class(mc.architecture)(mc, attention, ops).to(config.dtype)
        if mc.quantization == "fp8":  # its FP8 weights load into FP8 layers as they are
            fp8.convert(model)
        if src.kind == "dummy":
            model.init_dummy_weights(config.seed)
        else:
            model.load_weights(load_weights(src, config.dtype))
        if config.quantization == "fp8" and mc.quantization != "fp8":
            fp8.quantize(model)
        if config.quantization == "fp8" and device.type == "cuda":
            fp8.quantize_logits(model)
        if self.cpu_weights == "bf16":
            cpu_linear.pack_bf16(model, model.logits_weight)
        elif self.cpu_weights == "fp16":
            cpu_linear.pack_fp16(model, model.logits_weight)
        elif self.cpu_weights == "gguf":
            cpu_linear.pack_gguf(model, model.logits_weight, load_gguf_blocks(src), gguf_types)
        model.eval()
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(src)
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.eos_token_ids = tuple(sorted(eos))

        cache = config.cache
        kv_dtype = cache.kv_dtype(config.dtype)
        num_blocks = num_kv_blocks(mc, cache, kv_dtype, device)
        max_len = min(
            config.scheduler.max_model_len, mc.max_position_embeddings,
            num_blocks * cache.block_size,
        )
        self.max_model_len = max_len
        pool = BlockPool(num_blocks, on_block_event)
        # The cache's dtype, as KVLayout names it and the router hashes prompts with: an
        # FP8 cache's blocks are never taken for a 16-bit cache's, nor the other way.
        dtype_name = str(kv_dtype).removeprefix("torch.")
        every_layer_slides = len(mc.sliding_layers) == mc.num_layers
        kv = KVCacheManager(
            pool, cache.block_size, root_hash(src.name, dtype_name, cache.block_size),
            cache.enable_prefix_caching, mc.sliding_window if every_layer_slides else 0,
        )
        self.block_pool = pool
        sched = replace(config.scheduler, max_model_len=max_len)
        self.scheduler = Scheduler(sched, kv)
        self.runner = ModelRunner(
            model, attention, Sampler(self.eos_token_ids), num_blocks, cache.block_size,
            sched.max_num_seqs, sched.max_num_batched_tokens, max_len, kv_dtype,
        )
        self.host_tier: HostTier | None = None
        if cache.host_kv_bytes and cache.enable_prefix_caching:
            per_block = block_bytes(self.runner.kv_caches)
            self.host_tier = HostTier(max(1, cache.host_kv_bytes // per_block),
                                      self.runner.kv_caches)
            kv.attach_host_tier(self.host_tier)
        # Decode-only and one-prompt steps replay CUDA graphs; they need a backend whose
        # per-layer work reads only tensors (triton), a model whose work does not depend
        # on the values (the experts' reference does), and cost memory and start-up time.
        self.cuda_graphs = (
            device.type == "cuda" and attention.name == "triton" and not config.enforce_eager
            and not model.data_dependent
        )
        if self.cuda_graphs:
            capture_graphs(self.runner, min(sched.max_num_seqs, sched.max_num_batched_tokens),
                           sched.max_num_batched_tokens, mixed=config.mixed_cuda_graphs)
        self.async_scheduling = (
            device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        self._launched: _Launched | None = None
        self._requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       self._finish)
        # Since start, for the node's metrics: prompt tokens computed here, and of the
        # requests that ended, all prompt tokens and those found in the prefix cache;
        # tokens generated.
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_queried = 0  # prompt tokens of ended requests
        self.num_prompt_tokens_cached = 0
        self.num_prompt_tokens_cached_host = 0  # of those, copied back from the host tier
        self.num_prompt_tokens_cached_peer = 0  # of those, pulled from a peer for the request
        self.prompt_tokens_timed = 0  # prompt tokens of the steps timed below
        self.prompt_step_seconds = 0.0
        self._step_ended = 0.0  # time.perf_counter() when the last step's tokens landed
        # Decode role: requests holding their prompt's blocks, waiting for its KV.
        self._reserved: dict[str, Request] = {}
        # Prefill role: called with a request just before the step that completes its
        # prompt; returns a callback run as each layer's KV is written in that step (a
        # KV push), or None. Must not raise. Not `prefill_layerwise`: the callbacks want
        # only the last layer, so the step may replay a CUDA graph and call them after it.
        self.prefill_hook: Callable[[Request], Callable[[int], None] | None] | None = None
        self.prefill_layerwise = True
        # Called with each layer once that layer's callbacks of a step all ran.
        self.prefill_handed: Callable[[int], None] | None = None

    # --- requests -------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenize; raises ValueError naming the problem. Changes nothing."""
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.validate_request(request_id, prompt, params, cache_salt)

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is in the engine (one dict lookup: any thread may ask)."""
        return request_id in self._requests

    def validate_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """`make_request` for an id that may be in use (a reservation's)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the context length is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        return Request(request_id, token_ids, params, cache_salt=cache_salt)

    def add(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._register(req)
        self.scheduler.add(req)

    def _register(self, req: Request) -> None:
        self._requests[req.request_id] = req
        self.outputs.register(req)

    # --- the decode role: a prompt's KV computed elsewhere ------------------------------

    def reserve(self, req: Request, keep_free: int = 0) -> int:
        """Give `req` the blocks of its whole prompt (a cached prefix is shared, not
        copied) and hold it, unscheduled, until `start_decode`, `start_prefill` or
        `release_reserved`; returns how many prompt tokens were cached (their KV is in
        place; `req.block_ids` past them await theirs). Raises KVCacheFull when the
        blocks are not free, or would leave fewer than `keep_free`."""
        kv = self.scheduler.kv
        hits = kv.find_cached_blocks(req, promote=True)
        cached = len(hits) * kv.block_size
        if not kv.allocate(req, req.num_prompt_tokens - cached, hits, keep_free):
            raise KVCacheFull(
                f"no room for {req.num_prompt_tokens} prompt tokens: "
                f"{self.block_pool.num_free_blocks} of {self.block_pool.num_blocks} blocks free"
            )
        self._register(req)
        self._reserved[req.request_id] = req
        return cached

    def cached_block_hashes(self) -> tuple[list[bytes], list[bytes]]:
        """Every block hash this engine holds: on the device, and only in its host tier."""
        device = self.block_pool.cached_hashes()
        if self.host_tier is None:
            return device, []
        held = set(device)
        return device, [h for h in self.host_tier.hashes() if h not in held]

    def cached_prompt_tokens(self, req: Request) -> int:
        """How many of `req`'s prompt tokens the prefix cache holds now (nothing is
        allocated: `reserve` or `add` may find fewer if blocks are evicted meanwhile)."""
        return self.scheduler.kv.cached_tokens(req)

    def start_decode(self, request_id: str, first_token: int) -> RequestOutput:
        """The reserved request's prompt KV is in place, and `first_token` was sampled
        from it: it joins the running batch (or finishes, if that token ends it)."""
        req = self._reserved.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.kv.cache_computed_blocks(req)
        self.scheduler.add_running(req)
        return self.outputs.append(req, first_token, None)

    def start_prefill(self, request_id: str) -> bool:
        """Compute the reserved request's prompt here after all (past its cached prefix,
        in the blocks it holds), then decode it; False if it is not reserved (any more)."""
        req = self._reserved.pop(request_id, None)
        if req is not None:
            self.scheduler.add_running(req)
        return req is not None

    def adopt_reserved(self, request_id: str) -> None:
        """The reserved request's prompt KV came from a peer (a prefix pull): its blocks
        join the prefix cache and the request goes, leaving them there, free."""
        req = self._reserved.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.kv.cache_computed_blocks(req)
        self.scheduler.kv.free(req)
        del self._requests[request_id]
        self.outputs.forget(request_id)

    def release_reserved(self, request_id: str) -> None:
        """Give back a reserved request's blocks; nothing if it is not reserved."""
        req = self._reserved.pop(request_id, None)
        if req is not None:
            self.scheduler.kv.free(req)
            del self._requests[request_id]
            self.outputs.forget(request_id)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def request_ids(self) -> list[str]:
        """Every request not finished: waiting, running, or reserved."""
        return list(self._requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        req = self.make_request(request_id, prompt, params, cache_salt)
        self.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        if request_id in self._reserved:
            self.release_reserved(request_id)
            req.status = RequestStatus.FINISHED_ABORTED
            return RequestOutput.of(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return RequestOutput.of(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._launched is not None

    @property
    def num_generation_tokens(self) -> int:
        return self.outputs.num_generation_tokens

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # --- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.host_tier is not None:
            self.host_tier.settle()  # the loads that ended count in the measured rate now
        batch = self.scheduler.schedule()
        on_layer = self._layer_callback(batch) if batch.requests else None
        sampling = batch.sampling_requests()  # before postprocess advances the counts
        if (self.async_scheduling and batch.requests
                and (on_layer is None or not self.prefill_layerwise)
                and all(r.params.device_sampled for r in sampling)):
            return self._step_ahead(batch, sampling, on_layer)
        outputs = self._land()
        if outputs:  # requests that stopped at the landed step leave this one
            batch = batch.without_finished()
            sampling = batch.sampling_requests()
        if not batch.requests:
            return outputs
        began = time.perf_counter()
        computed = self._count_prompt_tokens(batch)
        sampled = self.runner.run(batch, sampling, on_layer, self.prefill_layerwise)
        self._timed(computed, began)  # run() waits for the step's tokens
        self.scheduler.postprocess(batch)
        append = self.outputs.append
        return outputs + [append(req, token, logprobs) for req, token, logprobs
                          in zip(sampling, sampled.token_ids, sampled.logprobs)]

    def _step_ahead(self, batch: ScheduledBatch, sampling: list[Request],
                    on_layer: Callable[[int], None] | None) -> list[RequestOutput]:
        """Launch this step, then read and postprocess the previous one while it runs.
        A prefill hook's callbacks (not layerwise) run as the step is launched; the
        prompts' first tokens come when it lands."""
        began = time.perf_counter()
        computed = self._count_prompt_tokens(batch)
        launched = _Launched(sampling, self.runner.launch(batch, sampling, on_layer),
                             computed, began)
        for req in sampling:
            req.output_token_ids.append(PENDING_TOKEN)
        outputs = self._land()
        self._launched = launched
        self.scheduler.postprocess(batch)  # after landing: the hashes see real tokens
        return outputs

    def _land(self) -> list[RequestOutput]:
        """Read the tokens of the step launched ahead, if any, and append them."""
        launched, self._launched = self._launched, None
        if launched is None:
            return []
        tokens = launched.tokens.result()
        self._timed(launched.prompt_tokens, launched.began)
        return self.outputs.land(launched.requests, tokens)

    def _count_prompt_tokens(self, batch: ScheduledBatch) -> int:
        """The prompt tokens the step computes, counted."""
        if batch.num_tokens == len(batch.requests):  # a decode computes no prompt token
            return 0
        computed = sum(max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                              - req.num_computed_tokens)
                       for req, n in zip(batch.requests, batch.num_new_tokens))
        self.num_prompt_tokens_computed += computed
        return computed

    def _timed(self, prompt_tokens: int, began: float) -> None:
        """A step ended: if it computed prompt tokens, its time since `began` (its launch)
        or since the step before it ended, whichever is later, prices a computed token
        against one found in a tier (mixed steps overcharge). A step launched ahead
        waits for the one before it: timed from its launch, back-to-back prompt steps
        each counted two steps' time, and the router's --prefill-overflow-ms saw half
        the prefill node's rate."""
        now = time.perf_counter()
        if prompt_tokens:
            self.prompt_tokens_timed += prompt_tokens
            self.prompt_step_seconds += now - max(began, self._step_ended)
        self._step_ended = now

    def _layer_callback(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """The prefill hook's callbacks for the requests whose prompt this step completes."""
        if self.prefill_hook is None:
            return None
        callbacks = [cb for i, req in enumerate(batch.requests)
                     if not req.output_token_ids and batch.samples(i)
                     and (cb := self.prefill_hook(req)) is not None]
        handed = self.prefill_handed
        if not callbacks or (len(callbacks) == 1 and handed is None):
            return callbacks[0] if callbacks else None

        def each(layer: int) -> None:
            for cb in callbacks:
                cb(layer)
            if handed is not None:
                handed(layer)

        return each

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.output_token_ids and req.output_token_ids[-1] == PENDING_TOKEN:
            req.output_token_ids.pop()  # aborted with a step in flight: never read
        self.num_prompt_tokens_cached += req.num_cached_tokens
        self.num_prompt_tokens_cached_host += req.num_host_cached_tokens
        self.num_prompt_tokens_cached_peer += min(req.num_peer_cached_tokens,
                                                  req.num_cached_tokens)
        self.num_prompt_tokens_queried += req.num_prompt_tokens
        self.scheduler.finish(req, status)
        self.runner.release(req.request_id)
        del self._requests[req.request_id]
        self.outputs.forget(req.request_id)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer; pass token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            # Checked in C, not a Python step per token: a node checks every Generate's
            # prompt on its asyncio thread, beside the engine's.
            if not set(map(type, token_ids)) <= {int}:  # bool, a float: refused
                raise ValueError("prompt token ids must be integers")
            vocab = self.model_config.vocab_size
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
                bad = next(t for t in token_ids if not 0 <= t < vocab)
                raise ValueError(
                    f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
                )
        if not token_ids:
            raise ValueError("prompt is empty")
        return token_ids


def run_to_completion(
    engine: LLMEngine, reqs: list[Request], use_tqdm: bool = False
) -> dict[str, RequestOutput]:
    bind_thread(engine.device)  # the caller's thread may be any (LLM.generate's)
    for req in reqs:
        engine.add(req)
    done: dict[str, RequestOutput] = {}
    with tqdm(total=len(reqs), disable=not use_tqdm, desc="generate") as bar:
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    return done


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
