"""`tandem` command line: generate (offline), serve, bench."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options, named as vLLM names them."""
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: built-in demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (CPU)")
    p.add_argument("--host-kv-cache-memory", type=int, default=None,
                   help="bytes of host memory per group for evicted prefix blocks (default 0: none)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    p.add_argument("--no-cpu-packed-weights", dest="cpu_packed_weights", action="store_false", default=None,
                   help="CPU float32: do not keep a copy of each linear weight in MKL's packed layout "
                        "(saves ~1.2x the linear weights' memory; batched decode runs ~1.2x slower)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    p.add_argument("--speculative-model", default=None, help='draft model directory, or "ngram"')
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--speculative-draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft model's dtype (default auto: the target's)")
    p.add_argument("--speculative-draft-tensor-parallel-size", type=int, default=None,
                   help="the draft model's own tensor-parallel size (default 1)")
    p.add_argument("--address", default=None, help="Ray cluster address to join")
    p.add_argument("--seed", type=int, default=None)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options a parsed command line sets (unset flags keep engine defaults)."""
    names = ["model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
             "kv_cache_memory", "host_kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching", "tensor_parallel_size",
             "pipeline_parallel_size", "speculative_model", "num_speculative_tokens", "speculative_draft_dtype",
             "speculative_draft_tensor_parallel_size", "address", "seed", "cpu_packed_weights"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _cmd_generate(args: argparse.Namespace) -> int:
    from tandem.workers.llm import LLM
    from tandem.workers.core.request import SamplingParams

    llm = LLM(**engine_options(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or ["The capital of France is", "Once upon a time"]
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        completion = out.outputs[0]
        print(f"prompt: {prompt!r}\ngenerated: {completion.text!r}  "
              f"({len(completion.token_ids)} tokens, finish reason: {completion.finish_reason})")
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Distributed LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline from a model (no server)")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)
    for register in _subcommand_registrars():
        register(sub, _add_engine_args)
    return parser


def _subcommand_registrars() -> list:
    """Modules that add their own subcommands (`bench`, `serve`) without crowding this file."""
    registrars = []
    for module in ("tandem.bench.cli", "tandem.router.serve_cli"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # that part is not built yet
            raise
        registrars.append(mod.register)
    return registrars


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
