"""One engine: a model on a device, its paged KV cache, scheduler, runner and sampler.
`step()` is schedule → run → postprocess."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from tqdm import tqdm

from tandem.engine.attention import make_backend
from tandem.engine.block_hash import root_hash
from tandem.engine.block_pool import BlockPool, EventHook
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import DecodeGraphs
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.loader import load_model_config, load_tokenizer, load_weights, resolve_model
from tandem.engine.model_runner import ModelRunner, num_kv_blocks
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.ops import ops_for
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import Sampler, SamplerOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.tokenizer import IncrementalDetokenizer, find_stop_string


def _resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use 'cpu' or 'cuda'")
    return device


class LLMEngine:
    def __init__(self, config: EngineConfig, on_block_event: EventHook | None = None) -> None:
        self.config = config
        src = resolve_model(config.model, config.load_format)
        self.model_name = src.name
        self.model_config = mc = load_model_config(src)
        device = _resolve_device(config.device)
        torch.manual_seed(config.seed)
        attention = make_backend(
            config.attention_backend, device, config.cache.block_size, mc.num_kv_heads
        )
        self.attention_backend = attention.name
        with torch.device(device):
            ops = ops_for(attention.name, device)
            model = LlamaForCausalLM(mc, attention, ops).to(config.dtype)
        if src.kind == "dummy":
            model.init_dummy_weights(config.seed)
        else:
            model.load_weights(load_weights(src, config.dtype))
        model.eval()
        self.tokenizer = load_tokenizer(src)
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.eos_token_ids = tuple(sorted(eos))

        cache = config.cache
        num_blocks = num_kv_blocks(mc, cache, config.dtype, device)
        max_len = min(
            config.scheduler.max_model_len, mc.max_position_embeddings,
            num_blocks * cache.block_size,
        )
        self.max_model_len = max_len
        pool = BlockPool(num_blocks, on_block_event)
        dtype_name = str(config.dtype).removeprefix("torch.")
        kv = KVCacheManager(
            pool, cache.block_size, root_hash(src.name, dtype_name, cache.block_size),
            cache.enable_prefix_caching,
        )
        self.block_pool = pool
        sched = replace(config.scheduler, max_model_len=max_len)
        self.scheduler = Scheduler(sched, kv)
        self.runner = ModelRunner(
            model, attention, Sampler(self.eos_token_ids), num_blocks, cache.block_size,
            sched.max_num_seqs, sched.max_num_batched_tokens, max_len,
        )
        # Decode-only steps replay CUDA graphs; they need a backend whose per-layer work
        # reads only tensors (triton), and cost memory and start-up time.
        self.cuda_graphs = (
            device.type == "cuda" and attention.name == "triton" and not config.enforce_eager
        )
        if self.cuda_graphs:
            graphs = DecodeGraphs(
                self.runner, min(sched.max_num_seqs, sched.max_num_batched_tokens)
            )
            graphs.capture()
            self.runner.graphs = graphs
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Since start, for the node's metrics: prompt tokens computed here, and of the
        # requests that ended, all prompt tokens and those found in the prefix cache;
        # tokens generated.
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_queried = 0  # prompt tokens of ended requests
        self.num_prompt_tokens_cached = 0
        self.num_generation_tokens = 0
        # Decode role: requests holding their prompt's blocks, waiting for its KV.
        self._reserved: dict[str, Request] = {}
        # Prefill role: called with a request just before the step that completes its
        # prompt; returns a callback run as each layer's KV is written in that step (a
        # KV push), or None. Must not raise.
        self.prefill_hook: Callable[[Request], Callable[[int], None] | None] | None = None

    # --- requests -------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenize; raises ValueError naming the problem. Changes nothing."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.validate_request(request_id, prompt, params, cache_salt)

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
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
            )

    # --- the decode role: a prompt's KV computed elsewhere ------------------------------

    def reserve(self, req: Request) -> int:
        """Give `req` the blocks of its whole prompt (a cached prefix is shared, not
        copied) and hold it, unscheduled, until `start_decode`, `start_prefill` or
        `release_reserved`; returns how many prompt tokens were cached (their KV is in
        place; `req.block_ids` past them await theirs). Raises RuntimeError when the
        blocks are not free."""
        kv = self.scheduler.kv
        hits = kv.find_cached_blocks(req)
        cached = len(hits) * kv.block_size
        if not kv.allocate(req, req.num_prompt_tokens - cached, hits):
            raise RuntimeError(
                f"no room for {req.num_prompt_tokens} prompt tokens: "
                f"{self.block_pool.num_free_blocks} of {self.block_pool.num_blocks} blocks free"
            )
        self._register(req)
        self._reserved[req.request_id] = req
        return cached

    def start_decode(self, request_id: str, first_token: int) -> RequestOutput:
        """The reserved request's prompt KV is in place, and `first_token` was sampled
        from it: it joins the running batch (or finishes, if that token ends it)."""
        req = self._reserved.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.kv.cache_computed_blocks(req)
        self.scheduler.add_running(req)
        return self._append([req], SamplerOutput([first_token], [None]))[0]

    def start_prefill(self, request_id: str) -> bool:
        """Compute the reserved request's prompt here after all (past its cached prefix,
        in the blocks it holds), then decode it; False if it is not reserved (any more)."""
        req = self._reserved.pop(request_id, None)
        if req is not None:
            self.scheduler.add_running(req)
        return req is not None

    def release_reserved(self, request_id: str) -> None:
        """Give back a reserved request's blocks; nothing if it is not reserved."""
        req = self._reserved.pop(request_id, None)
        if req is not None:
            self.scheduler.kv.free(req)
            del self._requests[request_id]
            self._detok.pop(request_id, None)

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
        return self.scheduler.has_unfinished

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # --- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        sampling = batch.sampling_requests()  # before postprocess advances the counts
        if batch.num_tokens != len(batch.requests):  # a decode computes no prompt token
            for req, n in zip(batch.requests, batch.num_new_tokens):
                start = req.num_computed_tokens
                self.num_prompt_tokens_computed += max(
                    0, min(start + n, req.num_prompt_tokens) - start
                )
        sampled = self.runner.run(batch, sampling, self._layer_callback(batch))
        self.scheduler.postprocess(batch)
        return self._append(sampling, sampled)

    def _layer_callback(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """The prefill hook's callbacks for the requests whose prompt this step completes."""
        if self.prefill_hook is None:
            return None
        callbacks = [cb for i, req in enumerate(batch.requests)
                     if batch.samples(i) and req.num_output_tokens == 0
                     and (cb := self.prefill_hook(req)) is not None]
        if len(callbacks) < 2:
            return callbacks[0] if callbacks else None

        def each(layer: int) -> None:
            for cb in callbacks:
                cb(layer)

        return each

    def _append(self, reqs: list[Request], sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = []
        for req, token, logprobs in zip(reqs, sampled.token_ids, sampled.logprobs):
            req.output_token_ids.append(token)
            self.num_generation_tokens += 1
            if logprobs is not None:
                req.output_logprobs.append(logprobs)
            delta = self._detokenize(req, token)
            status = self._check_stop(req, token, delta)
            if status is RequestStatus.FINISHED_LENGTH:
                delta += self._flush_text(req)  # a character cut off mid-way by the limit
            if status is not None:
                self._finish(req, status)
            outputs.append(RequestOutput.of(req, delta))
        return outputs

    def _detokenize(self, req: Request, token: int) -> str:
        detok = self._detok.get(req.request_id)
        if detok is None:
            return ""
        delta = detok.add(token)
        req.output_text += delta
        return delta

    def _flush_text(self, req: Request) -> str:
        detok = self._detok.get(req.request_id)
        rest = detok.flush() if detok is not None else ""
        req.output_text += rest
        return rest

    def _check_stop(self, req: Request, token: int, delta: str) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop and delta:
                cut = find_stop_string(
                    req.output_text, p.stop, len(delta), p.include_stop_str_in_output
                )
                if cut is not None:
                    req.stop_reason = _matched_stop(
                        req.output_text, p.stop, cut, p.include_stop_str_in_output
                    )
                    req.output_text = req.output_text[:cut]
                    return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.num_prompt_tokens_cached += req.num_cached_tokens
        self.num_prompt_tokens_queried += req.num_prompt_tokens
        self.scheduler.finish(req, status)
        self.runner.release(req.request_id)
        del self._requests[req.request_id]
        self._detok.pop(req.request_id, None)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer; pass token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt token ids must be integers")
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token id {bad[0]} is outside the vocabulary "
                    f"[0, {self.model_config.vocab_size})"
                )
        if not token_ids:
            raise ValueError("prompt is empty")
        return token_ids


def _matched_stop(text: str, stops: Sequence[str], cut: int, included: bool) -> str | None:
    for s in stops:
        if (text[:cut].endswith(s) if included else text.startswith(s, cut)):
            return s
    return None


def run_to_completion(
    engine: LLMEngine, reqs: list[Request], use_tqdm: bool = False
) -> dict[str, RequestOutput]:
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
