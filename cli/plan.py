"""`tandem plan MODEL`: what a model needs on a cluster, and the commands that deploy it.

    tandem plan MODEL [--gpu NAME | --gpu-memory GIB [--gpu-bandwidth GBPS] | --device cpu]
        [--gpus-per-node N] [--nodes M] [--dtype D] [--quantization Q] [--kv-cache-dtype K]
        [--max-model-len L] [--context-len C] [--concurrency S] [--gpu-memory-utilization U]
        [--output-json PATH|-]

MODEL is what `tandem serve` takes (a directory, a Hub repo id, an s3:// or gs:// URI; only its
config.json is read), or a config.json's path. The arithmetic is workers/model/plan.py's; this
module reads the options, prints the table and writes the `tandem serve` and
`tandem deploy kuberay` command lines that realise the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tandem.workers.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, CacheConfig
from tandem.workers.device_specs import CPU_STEP_OVERHEAD_S, GPU_SPECS, DeviceSpec, gpu_spec
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.plan import DEFAULT_MAX_NUM_SEQS, DeploymentPlan, PlanRequest

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEFAULT_CONTEXT_LEN = 1024
# Methods whose GEMMs multiply FP8 activations by FP8 weights (W8A8) where the card can.
FP8_MATMUL_METHODS = ("fp8", "fbgemm_fp8")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="what a model needs on a cluster: layout, KV capacity, time per token")
    p.add_argument("model", metavar="MODEL", help="a model directory, Hub repo id, s3:// / gs:// URI, or a config.json")
    p.add_argument("--revision", default=None, help="the model's Hub revision")
    device = p.add_mutually_exclusive_group()
    device.add_argument("--gpu", default=None, metavar="NAME",
                        help=f"the card: {', '.join(GPU_SPECS)}, or cpu (default: H100-SXM-80GB)")
    device.add_argument("--gpu-memory", type=float, default=None, metavar="GIB", help="another card's memory")
    device.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cpu: this machine, its bandwidth and FLOP/s probed (a few seconds)")
    p.add_argument("--gpu-bandwidth", type=float, default=None, metavar="GBPS",
                   help="with --gpu-memory: its memory bandwidth (default: an H100 SXM's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs of one node (default 8; cpu: 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the cluster")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: the config's torch_dtype (float32 on CPU, as the engine runs)")
    p.add_argument("--quantization", "-q", choices=("none", *QUANTIZATION_METHODS), default=None,
                   help="8-bit linear weights (1 byte a parameter; embeddings, lm_head and norms stay in dtype); "
                        "default: the checkpoint's quantization_config, or none")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="fp8: 1 byte a KV element")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens of prompt and output (default: the model's)")
    p.add_argument("--context-len", type=int, default=None,
                   help=f"keys a decode step attends to, for time per token and throughput "
                        f"(default: {DEFAULT_CONTEXT_LEN} or max-model-len if shorter)")
    p.add_argument("--concurrency", type=int, default=64, help="sequences one replica group keeps decoding")
    p.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                   help="share of a GPU's memory the group may use, as the engine's option")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the plan as JSON here (-: stdout)")
    p.set_defaults(func=_cmd_plan)


def load_config(model: str, revision: str | None) -> HFModelConfig:
    """The model's config; a config.json's path is read from its directory."""
    if os.path.basename(model) == "config.json" and os.path.isfile(model):
        model = os.path.dirname(model) or "."
    try:
        return HFModelConfig.from_dir(model, revision)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:  # a bad file, not a bug: exit 2
        raise ValueError(f"model: cannot read {model!r}'s config: {exc!r}") from exc


def plan_request(args: argparse.Namespace, cfg: HFModelConfig) -> PlanRequest:
    import torch

    on_cpu = args.device == "cpu" or (args.gpu or "").lower() == "cpu"
    dtype = cfg.resolve_dtype(args.dtype, torch.device("cpu" if on_cpu else "cuda"))
    method = _quantization(args.quantization, cfg)
    max_model_len = cfg.max_position_embeddings if args.max_model_len is None else args.max_model_len
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} is longer than the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    if on_cpu and (args.gpus_per_node not in (None, 1) or args.nodes != 1):
        raise ValueError("a CPU plan is this one machine: --gpus-per-node and --nodes do not apply")
    return PlanRequest(
        cfg=cfg, device=_device(args, on_cpu, dtype.itemsize), itemsize=dtype.itemsize,
        weight_itemsize=1 if method else None, kv_itemsize=1 if args.kv_cache_dtype != "auto" else None,
        fp8_matmuls=method in FP8_MATMUL_METHODS, num_nodes=args.nodes, max_model_len=max_model_len,
        gpus_per_node=1 if on_cpu else (8 if args.gpus_per_node is None else args.gpus_per_node),
        context_len=min(DEFAULT_CONTEXT_LEN, max_model_len) if args.context_len is None else args.context_len,
        concurrency=args.concurrency,
        gpu_memory_utilization=args.gpu_memory_utilization)


def _quantization(option: str | None, cfg: HFModelConfig) -> str | None:
    """The method the linear weights run in: the option's, else the checkpoint's (as the engine reads it)."""
    checkpoint = (cfg.quantization_config or {}).get("quant_method")
    if checkpoint and option not in (None, "none", checkpoint):
        raise ValueError(f"--quantization {option}: the checkpoint is quantized with {checkpoint}")
    return checkpoint or (None if option in (None, "none") else option)


def _device(args: argparse.Namespace, on_cpu: bool, itemsize: int) -> DeviceSpec:
    if on_cpu:
        return DeviceSpec.probe_cpu(itemsize, CPU_STEP_OVERHEAD_S)
    if args.gpu_bandwidth is not None and args.gpu_memory is None:
        raise ValueError("--gpu-bandwidth goes with --gpu-memory")
    if args.gpu_memory is not None:
        return DeviceSpec.custom(args.gpu_memory, args.gpu_bandwidth)
    return gpu_spec(args.gpu or "H100-SXM-80GB")


def serve_args(args: argparse.Namespace, plan: DeploymentPlan) -> list[str]:
    """`tandem serve` arguments (after `tandem`) that run the plan's layout and options."""
    req, shown = plan.request, plan.shown
    out = ["serve", args.model]
    if req.device.name.startswith("cpu"):
        out += ["--device", "cpu"]
    if shown is not None:
        out += ["-tp", str(shown.tensor_parallel_size), "-pp", str(shown.pipeline_parallel_size)]
    if plan.num_replicas > 1:
        out += ["--num-replicas", str(plan.num_replicas)]
    return out + _engine_flags(args, req)


def _engine_flags(args: argparse.Namespace, req: PlanRequest) -> list[str]:
    out = []
    if args.revision:
        out += ["--revision", args.revision]
    if args.dtype != "auto":
        out += ["--dtype", args.dtype]
    if args.quantization not in (None, "none"):
        out += ["--quantization", args.quantization]
    if args.kv_cache_dtype != "auto":
        out += ["--kv-cache-dtype", args.kv_cache_dtype]
    out += ["--max-model-len", str(req.max_model_len)]
    if req.concurrency > DEFAULT_MAX_NUM_SEQS:  # the engine would cap the batch below the workload
        out += ["--max-num-seqs", str(req.concurrency)]
    if req.gpu_memory_utilization != CacheConfig.gpu_memory_utilization:
        out += ["--gpu-memory-utilization", str(req.gpu_memory_utilization)]
    return out


def kuberay_args(args: argparse.Namespace, plan: DeploymentPlan) -> list[str] | None:
    """`tandem deploy kuberay` arguments for the plan's layout (GPU plans only). The engine options
    beyond the layout go into the Serve config's `args` (`serve_config_args`)."""
    shown = plan.shown
    if shown is None or plan.request.device.name.startswith("cpu"):
        return None
    replicas = max(1, plan.num_replicas)
    return ["deploy", "kuberay", "-tp", str(shown.tensor_parallel_size), "-pp", str(shown.pipeline_parallel_size),
            "--gpus-per-node", str(plan.request.gpus_per_node), "--num-replicas", str(replicas),
            "--model", args.model]


def serve_config_args(args: argparse.Namespace, plan: DeploymentPlan) -> dict[str, Any]:
    """The engine options of `serve_args` beyond the layout, as deploy/serve_config.yaml's `args` names them."""
    flags = _engine_flags(args, plan.request)
    return {flag.removeprefix("--").replace("-", "_"): _plain(value) for flag, value in zip(flags[::2], flags[1::2])}


def _plain(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _cmd_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.model, args.revision)
    plan = DeploymentPlan.make(plan_request(args, cfg))
    figures = {**plan.figures(), "serve_args": serve_args(args, plan), "kuberay_args": kuberay_args(args, plan),
               "serve_config_args": serve_config_args(args, plan)}
    if args.output_json == "-":
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0
    print(render(figures))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
            f.write("\n")
    return 0


def render(figures: dict[str, Any]) -> str:
    """The plan as a table, then its reason, suggestions and command lines."""
    rows = _rows(figures)
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += ["", f"why: {figures['reason']}"]
    lines += [f"suggestion: {s}" for s in figures["suggestions"]]
    lines += ["", "tandem " + " ".join(figures["serve_args"])]
    if figures["kuberay_args"]:
        lines += ["tandem " + " ".join(figures["kuberay_args"]),
                  f"  with the Serve config's args: {json.dumps(figures['serve_config_args'])}"]
    return "\n".join(lines)


def _rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    minimum = f["min_layout"]
    rows = [
        ("device", f"{f['device']} x {f['gpus_per_node']} per node, {f['num_nodes_available']} node(s)"),
        ("parameters", f"{f['num_params']:,}"),
        ("weight bytes", f"{f['weight_bytes']:,} ({_gb(f['weight_bytes'])})"),
        ("KV bytes per token", f"{f['kv_bytes_per_token']:,}"),
        ("smallest layout that fits", "-" if minimum is None else _layout(minimum)),
        ("fits this cluster", "yes" if f["fits"] else "NO"),
    ]
    if f["tensor_parallel_size"] is None:
        return rows
    return rows + [
        ("layout" if f["fits"] else "layout (with more nodes)", _layout(f)),
        ("weights per GPU", _gb(f["weight_bytes_per_gpu"])),
        ("KV capacity per group", f"{f['kv_capacity_tokens']:,} tokens = {f['max_model_len_sequences']} x "
                                  f"{f['max_model_len']}-token sequences"),
        ("replica groups", str(f["num_replicas"])),
        ("batch-1 time per token", f"{f['predicted_tpot_ms']:.3f} ms (context {f['context_len']})"),
        ("decode throughput per group", f"{f['predicted_decode_tokens_per_s']:,.0f} tok/s at batch "
                                        f"{f['decode_batch']} (concurrency {f['concurrency']})"),
    ]


def _layout(f: dict[str, Any]) -> str:
    return f"TP={f['tensor_parallel_size']} x PP={f['pipeline_parallel_size']} ({f['num_nodes']} node(s))"


def _gb(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1e9:,.2f} GB"
