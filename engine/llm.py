"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, parse_dtype
from tandem.engine.llm_engine import LLMEngine, run_to_completion
from tandem.engine.loader import load_generation_defaults, resolve_model
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Messages = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        load_format: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int = 1 << 30,
        host_kv_bytes: int = 0,
        kv_cache_memory_fraction: float = 0.85,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 8192,
        attention_backend: str | None = None,
        enforce_eager: bool = False,
        mixed_cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        cpu_weights: str = "fp32",
    ) -> None:
        config = EngineConfig(
            model=model,
            load_format=load_format,
            dtype=parse_dtype(dtype),
            device=device,
            seed=seed,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_kv_blocks,
                kv_cache_bytes=kv_cache_bytes,
                host_kv_bytes=host_kv_bytes,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            mixed_cuda_graphs=mixed_cuda_graphs,
            async_scheduling=async_scheduling,
            quantization=quantization,
            cpu_weights=cpu_weights,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        # generate() without params samples with the model's generation_config.json.
        self._defaults = load_generation_defaults(resolve_model(config.model,
                                                                config.load_format))

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without params: SamplingParams() with the
        fields the model's generation_config.json sets (as vLLM's)."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError(f"model {self.engine.model_name!r} has no tokenizer")
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is validated before any runs,
        so a bad one raises ValueError (naming its index) and nothing else is affected."""
        batch = _as_prompt_list(prompts)
        params_list = _as_params_list(
            self.get_default_sampling_params() if params is None else params, len(batch))
        reqs = []
        for i, (prompt, p) in enumerate(zip(batch, params_list)):
            try:
                reqs.append(self.engine.make_request(f"gen-{next(self._ids)}", prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        done = run_to_completion(self.engine, reqs, use_tqdm)
        return [done[r.request_id] for r in reqs]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, params, use_tqdm)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams], n: int
                    ) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params
