"""`tandem generate`: the offline engine behind a command line, streaming to stdout."""

from __future__ import annotations

import argparse
import sys

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, parse_dtype
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

SAMPLE_PROMPT = "What is the capital of France?"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=parse_dtype(args.dtype),
        device=args.device,
        seed=args.seed,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            kv_cache_memory_fraction=args.gpu_memory_fraction,
            enable_prefix_caching=not args.no_prefix_caching,
            host_kv_bytes=int(args.kv_host_gib * (1 << 30)),
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        mixed_cuda_graphs=args.mixed_cuda_graphs,
        async_scheduling=args.async_scheduling,
        skip_tokenizer_init=args.skip_tokenizer_init,
        quantization=args.quantization,
        cpu_weights=args.cpu_weights,
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad flags fail before the model loads
    engine = LLMEngine(engine_config(args))
    prompts = args.prompt or [SAMPLE_PROMPT]
    for i, text in enumerate(prompts):
        if args.raw or engine.tokenizer is None:
            prompt = text
        else:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        engine.add_request(f"cli-{i}", prompt, params)
        print(f">>> {text}", flush=True)
        while engine.has_unfinished:
            for out in engine.step():
                sys.stdout.write(out.delta)
                sys.stdout.flush()
                if out.finished:
                    print(f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    return 0
