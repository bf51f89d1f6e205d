"""`tandem deploy`: deployment files generated from deploy/serve_config.yaml.

    tandem deploy kuberay [--kind rayservice|raycluster] [--config FILE] [--num-replicas N]
        [-tp T] [-pp P] [--gpus-per-node G] [--spare-gpus S] [--image IMAGE] [--name NAME]
        [--model PATH|ORG/NAME|s3://...|gs://...] [--model-pvc CLAIM] [--cache-pvc CLAIM]
        [--hf-token-secret NAME[:KEY]]
        [--upgrade-strategy S] [--gateway-class C] [--upgrade-interval-s I] [--upgrade-step-percent P]
        [--redis create | --redis-address HOST:PORT --redis-password-secret NAME[:KEY]
         | --no-gcs-fault-tolerance]
        [--gpu-node-selector KEY=VALUE]... [--gpu-toleration KEY[=VALUE]:EFFECT]... [--output FILE]
    tandem deploy serve-config [--config FILE] [--device cuda] [--model M] [--output FILE]

The Serve application lives in one place, deploy/serve_config.yaml (installed with tandem, so
the commands run from any directory; --config reads another). A RayService carries it as
`serveConfigV2` with the layout flags, the model and `device: cuda` applied, and its GPU worker
group is sized for the layout: `num_replicas x TP x PP` GPUs plus `--spare-gpus` (draft models),
in pods of `--gpus-per-node` GPUs. A stage's TP ranks share a node, so TP may not exceed the
GPUs of one pod. `serve-config` writes the config a GPU Ray cluster deploys with `serve deploy`
(deploy/ray-cluster.yaml runs it). deploy/kuberay/*.yaml are `kuberay` output; a test
regenerates them with the command their first line records and fails when they differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from tandem.cli.gcs_ft import PASSWORD_KEY, GcsFaultTolerance
from tandem.cli.gpu_scheduling import EFFECTS, GpuScheduling
from tandem.cli.k8s import SecretRef
from tandem.cli.kuberay import (
    DEFAULT_IMAGE,
    DEVICE,
    KINDS,
    KubeRayOptions,
    documents,
    node_port_params,
    pinned_ray_version,
    ray_cluster_spec,
)
from tandem.cli.kuberay_text import render
from tandem.cli.layout import Layout
from tandem.cli.model_source import HF_TOKEN_KEY, ModelSource
from tandem.cli.serve_config import DEFAULT_CONFIG, DEVICES, load_serve_config, serve_config, with_app_args
from tandem.cli.upgrade_strategy import DEFAULT_INTERVAL_S, STRATEGIES, UpgradeStrategy

# The names the rest of tandem and its tests use from here.
__all__ = ["DEFAULT_CONFIG", "DEFAULT_IMAGE", "KubeRayOptions", "Layout", "documents", "kuberay_options",
           "load_serve_config", "node_port_params", "pinned_ray_version", "ray_cluster_spec", "register", "render",
           "serve_config"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("deploy", help="deployment files (KubeRay, a Serve config) from the Serve config")
    sub = p.add_subparsers(dest="target", required=True)
    k = sub.add_parser("kuberay", help="a RayService (or RayCluster) manifest from deploy/serve_config.yaml")
    k.add_argument("--kind", choices=KINDS, default="rayservice")
    k.add_argument("--config", default=None,
                   help=f"the Serve config the RayService carries (default: tandem's {DEFAULT_CONFIG})")
    k.add_argument("--num-replicas", type=int, default=1, help="replica groups")
    k.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    k.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    k.add_argument("--gpus-per-node", type=int, default=1, help="GPUs of one worker pod")
    k.add_argument("--spare-gpus", type=int, default=0, help="GPUs beyond the groups' (draft models)")
    k.add_argument("--image", default=DEFAULT_IMAGE, help="the image built from deploy/Dockerfile")
    k.add_argument("--name", default="tandem")
    k.add_argument("--output", "-o", default=None, help="write here (default: stdout)")

    m = k.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="an absolute path in the pods, a Hugging Face repo id (org/name) or an s3:// / gs:// URI "
                        "(default: the built-in demo model)")
    m.add_argument("--model-pvc", default=None, metavar="CLAIM",
                   help="a PersistentVolumeClaim holding the model, mounted read-only at the model's parent "
                        "(a relative --model: at /models)")
    m.add_argument("--cache-pvc", default=None, metavar="CLAIM",
                   help="a downloaded model's cache: this claim, shared by the pods (default: an emptyDir per pod)")
    m.add_argument("--hf-token-secret", default=None, metavar="NAME[:KEY]",
                   help=f"HF_TOKEN from this Secret's key (default key: {HF_TOKEN_KEY})")

    u = k.add_argument_group("upgrades")
    u.add_argument("--upgrade-strategy", default=None,
                   choices=sorted({s for strategies in STRATEGIES.values() for s in strategies}),
                   help="RayService: NewCluster (default), NewClusterWithIncrementalUpgrade or None; "
                        "RayCluster: Recreate (default) or None")
    u.add_argument("--gateway-class", default=None, help="the incremental upgrade's GatewayClass")
    u.add_argument("--upgrade-interval-s", type=int, default=DEFAULT_INTERVAL_S,
                   help="the incremental upgrade's seconds between traffic steps")
    u.add_argument("--upgrade-step-percent", type=int, default=None,
                   help="the incremental upgrade's step of capacity and traffic (default: one group's share)")

    g = k.add_argument_group("GCS fault tolerance (default: on, with a Redis this manifest creates)")
    redis = g.add_mutually_exclusive_group()
    redis.add_argument("--redis", choices=["create"], default=None, help="create a Redis beside the cluster")
    redis.add_argument("--redis-address", default=None, metavar="HOST:PORT", help="use this Redis")
    redis.add_argument("--no-gcs-fault-tolerance", action="store_true",
                       help="no Redis: losing the head pod is then an outage")
    g.add_argument("--redis-password-secret", default=None, metavar="NAME[:KEY]",
                   help=f"the Redis password's Secret (default: NAME-redis, key {PASSWORD_KEY})")

    s = k.add_argument_group("GPU worker scheduling")
    s.add_argument("--gpu-node-selector", action="append", default=None, metavar="KEY=VALUE",
                   help="a node label the GPU pods need (repeatable)")
    s.add_argument("--gpu-toleration", action="append", default=None, metavar="KEY[=VALUE]:EFFECT",
                   help=f"a taint the GPU pods tolerate, EFFECT one of {', '.join(EFFECTS)} (repeatable; "
                        "default: nvidia.com/gpu:NoSchedule)")
    k.set_defaults(func=_cmd_kuberay)

    c = sub.add_parser("serve-config", help="the Serve config for `serve deploy` on a GPU Ray cluster")
    c.add_argument("--config", default=None,
                   help=f"the Serve config to start from (default: tandem's {DEFAULT_CONFIG})")
    c.add_argument("--device", choices=DEVICES, default=DEVICE,
                   help="the groups' device: cuda makes Serve wait for GPU nodes that join late")
    c.add_argument("--model", default=None, help="the application's model (default: the config's)")
    c.add_argument("--output", "-o", default=None, help="write here (default: stdout)")
    c.set_defaults(func=_cmd_serve_config)


def kuberay_options(args: argparse.Namespace) -> KubeRayOptions:
    """The options a parsed `tandem deploy kuberay` command line gives (ValueError when they clash)."""
    hf_token = None if args.hf_token_secret is None else SecretRef.parse(args.hf_token_secret, HF_TOKEN_KEY)
    password = None if args.redis_password_secret is None else SecretRef.parse(args.redis_password_secret,
                                                                                PASSWORD_KEY)
    return KubeRayOptions(
        kind=args.kind,
        layout=Layout(args.num_replicas, args.tensor_parallel_size, args.pipeline_parallel_size,
                      args.gpus_per_node, args.spare_gpus),
        name=args.name, image=args.image, config_path=args.config,
        upgrade=UpgradeStrategy(args.kind, args.upgrade_strategy, args.gateway_class, args.upgrade_interval_s,
                                args.upgrade_step_percent),
        gcs_ft=GcsFaultTolerance(not args.no_gcs_fault_tolerance, args.redis_address, password),
        gpu=GpuScheduling.parse(args.gpu_node_selector, args.gpu_toleration),
        model=ModelSource(args.model, args.model_pvc, args.cache_pvc, hf_token),
    )


def _write(text: str, output: str | None) -> int:
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_kuberay(args: argparse.Namespace) -> int:
    return _write(render(kuberay_options(args)), args.output)


def _cmd_serve_config(args: argparse.Namespace) -> int:
    app_args: dict[str, Any] = {"device": args.device}
    if args.model is not None:
        app_args["model"] = args.model
    config = with_app_args(load_serve_config(args.config), app_args)
    return _write(yaml.safe_dump(config, sort_keys=False), args.output)
