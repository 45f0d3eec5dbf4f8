"""`tandem` command line. Subcommands import their part lazily, so `--help` is instant."""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name (e.g. smollm2-135m-instruct), a .gguf file, a Hugging Face "
                        "directory (config.json + safetensors), or with --load-format dummy a "
                        "shape name (llama-3-8b, smollm2-135m, tiny) (default: %(default)s)")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "hf", "dummy"],
                   help="how to read --model; dummy gives random weights (default: %(default)s)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16"],
                   help="weight and KV cache dtype (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks (default: sized from memory)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step; longer prompts are prefilled in chunks "
                        "(default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=8192,
                   help="context length cap, prompt plus output (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse KV blocks across requests with shared prefixes")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for dummy weights and unseeded sampling (default: %(default)s)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p times the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in prompt or output")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string; repeat for several")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed for reproducible sampling")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: prefill/decode disaggregated LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate", help="generate text for one or more prompts offline",
        description="Load a model and generate text for each --prompt, streaming to stdout.",
    )
    gen.add_argument("--prompt", action="append", default=None,
                     help="prompt text; repeat for several (default: a sample question)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is instead of through the model's chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from tandem.engine.cli_generate import run_generate

    return run_generate(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
