"""`tandem` command line: generate (offline), serve, bench, deploy, plan."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.bench import cli as bench_cli
from tandem.cli import deploy as deploy_cli
from tandem.cli import plan as plan_cli
from tandem.cli import serve as serve_cli

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineFlag:
    """One engine option on the command line: its flags and argparse's keyword arguments.

    Every flag defaults to None (unset), so an option the command line leaves out keeps the
    engine's default; `dest`, the option's vLLM name, is argparse's own derivation."""

    flags: tuple[str, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flags[0].removeprefix("--").replace("-", "_")


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(("--model",), {"help": "a local Hugging Face model directory, a Hub repo id (org/name) or an s3:// or "
                                      "gs:// URI (default: the built-in demo model)"}),
    EngineFlag(("--tokenizer",), {"help": "the tokenizer's directory, repo id or URI (default: the model's)"}),
    EngineFlag(("--revision",), {"help": "the model's Hub revision: a branch, tag or commit (default: main)"}),
    EngineFlag(("--device",), {"choices": ["auto", "cpu", "cuda"],
                               "help": "auto: GPUs where the application is built sees them, else CPU"}),
    EngineFlag(("--dtype",), {"default": "auto", "choices": DTYPES,
                              "help": "auto: the checkpoint's dtype on CUDA, float32 on CPU"}),
    EngineFlag(("--quantization", "-q"), {
        "choices": ["fp8", "fp8_weight_only", "int8", "compressed-tensors", "fbgemm_fp8"],
        "help": "quantized linear weights: fp8 (W8A8: weights and activations in FP8 e4m3, on FP8 tensor cores "
                "where the GPU has them), fp8_weight_only, int8 (weight-only, W8A16); a full-precision checkpoint is "
                "quantized at load, a pre-quantized one is read as it is (default: the checkpoint's "
                "quantization_config, or none)"}),
    EngineFlag(("--kv-cache-dtype",), {
        "choices": ["auto", "fp8", "fp8_e4m3"],
        "help": "auto: the model's dtype; fp8: e4m3 blocks with per-layer K and V scales (the checkpoint's "
                "k_scale / v_scale, else 1.0), twice the tokens in the same memory"}),
    EngineFlag(("--max-model-len",), {"type": int, "help": "tokens of prompt and output (default: the model's)"}),
    EngineFlag(("--max-num-seqs",), {"type": int, "help": "requests running at once per group"}),
    EngineFlag(("--max-num-batched-tokens",), {"type": int, "help": "tokens one step computes"}),
    EngineFlag(("--block-size",), {"type": int, "help": "tokens per KV cache block"}),
    EngineFlag(("--kv-cache-memory",), {"type": int, "help": "bytes of KV cache (CPU)"}),
    EngineFlag(("--host-kv-cache-memory",), {
        "type": int, "help": "bytes of host memory per group for evicted prefix blocks (default 0: none)"}),
    EngineFlag(("--gpu-memory-utilization",), {
        "type": float, "help": "share of the GPU's memory the group may use (weights, activations, KV cache)"}),
    EngineFlag(("--no-enable-prefix-caching",), {"dest": "enable_prefix_caching", "action": "store_false",
                                                 "help": "do not reuse the KV of prompt prefixes seen before"}),
    EngineFlag(("--no-cpu-packed-weights",), {
        "dest": "cpu_packed_weights", "action": "store_false",
        "help": "CPU float32: do not keep a copy of each linear weight in MKL's packed layout "
                "(saves about the linear weights' size in memory; batched decode runs slower)"}),
    EngineFlag(("--enforce-eager",), {
        "action": "store_true", "help": "CUDA: run every step eagerly (no CUDA graphs)"}),
    EngineFlag(("--no-mixed-step-graphs",), {
        "dest": "mixed_step_graphs", "action": "store_false",
        "help": "CUDA: steps with prompt chunks beside decodes run eagerly (only pure decode steps replay graphs)"}),
    EngineFlag(("--max-mixed-graph-tokens",), {
        "type": int, "help": "CUDA: the largest step with prompt chunks that replays a graph (default 2048)"}),
    EngineFlag(("--max-seq-len-to-capture",), {
        "type": int, "help": "CUDA: decode steps with a longer sequence run eagerly (default 8192)"}),
    EngineFlag(("--attention-backend",), {
        "choices": ["auto", "triton", "torch"], "help": "auto: Triton kernels on CUDA, torch elsewhere"}),
    EngineFlag(("--num-scheduler-steps",), {
        "type": int, "help": "multi-step decoding: forward passes a step of decodes runs before "
                             "the host schedules again (default 1: off; needs TP = PP = 1 and no speculation)"}),
    EngineFlag(("--simulated-step-ms",), {
        "metavar": "BASE,PER_SEQ",
        "help": "simulate the device: load no weights and make each step's forward pass a wait of BASE + "
                "PER_SEQ x (requests in the step) ms, with deterministic tokens (never EOS); the scheduler, KV "
                "blocks, detokenizer and outputs stay real (e.g. 5.9,0.01 ~ an 8B model on an H100). "
                "TP = PP = 1, no speculation, no multi-step"}),
    EngineFlag(("--tensor-parallel-size", "-tp"), {"type": int, "help": "GPUs (workers) that split each layer"}),
    EngineFlag(("--pipeline-parallel-size", "-pp"), {"type": int, "help": "stages the layers are split into"}),
    EngineFlag(("--pipeline-inflight-batches",), {
        "type": int, "help": "steps in flight at once with pipeline stages, each of other requests, so every stage "
                             "stays busy (default: one a stage; 1: one step at a time, split into a micro-batch a "
                             "stage)"}),
    EngineFlag(("--pipeline-layer-partition",), {
        "metavar": "N,N,...", "help": "decoder layers per pipeline stage, first to last (default: balanced by what a "
                                      "decode step reads, the LM head counted on the last stage)"}),
    EngineFlag(("--speculative-config",), {
        "metavar": "JSON", "help": 'speculative decoding, as vLLM takes it: {"model": DRAFT, "num_speculative_tokens": '
                                   'K} or {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N} '
                                   '(keys: workers/speculative_config.py)'}),
    EngineFlag(("--speculative-model",), {"help": 'the draft model, or "ngram" (vLLM\'s older flag; '
                                                  'prefer --speculative-config)'}),
    EngineFlag(("--num-speculative-tokens",), {
        "type": int, "help": "draft tokens a step verifies (vLLM's older flag; prefer --speculative-config)"}),
    EngineFlag(("--speculative-draft-dtype",), {
        "choices": DTYPES, "help": "the draft model's dtype (default auto: the target's)"}),
    EngineFlag(("--speculative-draft-tensor-parallel-size",), {
        "type": int, "help": "the draft model's own tensor-parallel size (default 1)"}),
    EngineFlag(("--park-workers-after-s",), {
        "type": float, "help": "TP/PP groups: seconds without a step after which the workers wait off the "
                               "CPU instead of polling for the next step (default 1.0)"}),
    EngineFlag(("--address",), {"help": "Ray cluster address to join (auto: the running one; default: start a "
                                        "local Ray)"}),
    EngineFlag(("--seed",), {"type": int, "help": "the engine's random seed"}),
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help, as vLLM shows them; an unset engine flag's is the
    engine's own (engine_defaults), so "None" is never shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return action.help
        return super()._get_help_string(action)


def engine_defaults() -> dict[str, Any]:
    """Engine option -> its default (EngineConfig's fields)."""
    import dataclasses

    from tandem.workers.config import _PARTS

    return {f.name: f.default for cls in _PARTS.values() for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options, named as vLLM names them."""
    defaults = engine_defaults()
    for flag in ENGINE_FLAGS:
        kwargs = {"default": None, **flag.kwargs}
        shown = defaults.get(flag.dest)
        if kwargs["default"] is None and shown is not None and "(default" not in kwargs.get("help", "") \
                and kwargs.get("action") is None:
            kwargs["help"] = f"{kwargs.get('help', '')} (default: {shown})".lstrip()
        p.add_argument(*flag.flags, **kwargs)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options a parsed command line sets (unset flags keep engine defaults)."""
    return {flag.dest: getattr(args, flag.dest) for flag in ENGINE_FLAGS
            if getattr(args, flag.dest, None) is not None}


def _cmd_generate(args: argparse.Namespace) -> int:
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM

    llm = LLM(**engine_options(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or ["The capital of France is", "Once upon a time"]
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        completion = out.outputs[0]
        print(f"prompt: {prompt!r}\ngenerated: {completion.text!r}  "
              f"({len(completion.token_ids)} tokens, finish reason: {completion.finish_reason})")
    llm.shutdown()
    return 0


def _kv_holdings(app_name: str) -> dict[str, Any]:
    from tandem.router.kv_report import kv_holdings

    return kv_holdings(app_name)


def _grpc_messages() -> Any:
    from tandem.router import tandem_pb2

    return tandem_pb2


def _telemetry_cost() -> dict[str, float]:
    from tandem.router.telemetry_cost import telemetry_cpu_cost

    return telemetry_cpu_cost()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Distributed LLM serving on Ray.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate offline from a model (no server)", formatter_class=HelpFormatter)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)
    serve_cli.register(sub, add_engine_args, engine_options)
    bench_cli.register(sub, bench_cli.RouterHooks(add_engine_args, engine_options, serve_cli.local_app,
                                                  kv_holdings=_kv_holdings, grpc_servicer=serve_cli.GRPC_SERVICER,
                                                  grpc_messages=_grpc_messages, telemetry_cost=_telemetry_cost))
    deploy_cli.register(sub)
    plan_cli.register(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: its own usage line leads any error it or its command reports,
    and its help shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's own signature
        namespace, rest = super().parse_known_args(args, namespace)
        # The innermost subcommand's parser parses first (its namespace is copied out): it stays.
        if getattr(namespace, "parser", None) is None:
            namespace.parser = self
        return namespace, rest


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        # As argparse reports a bad flag: the command's usage, then the reason; exit code 2.
        command = getattr(args, "parser", parser)
        command.print_usage(sys.stderr)
        print(f"{command.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
