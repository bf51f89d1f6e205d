"""The Serve config a deployment carries: deploy/serve_config.yaml with the layout, the model
and the device applied to the tandem application's arguments."""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tandem.cli.layout import Layout

# Where the default lives in a checkout. An installed tandem carries the same file as package
# data (tandem.deploy), so the commands read it from any directory.
DEFAULT_CONFIG = "deploy/serve_config.yaml"
APP_IMPORT_PATH = "tandem.router.app:build_app"
DEVICES = ("auto", "cpu", "cuda")


def default_serve_config_text() -> str:
    return (resources.files("tandem.deploy") / "serve_config.yaml").read_text()


def load_serve_config(path: str | Path | None = None) -> dict[str, Any]:
    """The Serve config at `path`, or tandem's default (deploy/serve_config.yaml) when None."""
    return yaml.safe_load(default_serve_config_text() if path is None else Path(path).read_text())


def with_app_args(base: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """`base` (a Serve config with the tandem application) with `args` set among the application's
    arguments; base itself is left as it was."""
    if args.get("device", "auto") not in DEVICES:
        raise ValueError(f"device: must be one of {', '.join(DEVICES)}, got {args['device']!r}")
    config = copy.deepcopy(base)
    [app] = [a for a in config["applications"] if a["import_path"] == APP_IMPORT_PATH]
    app.setdefault("args", {}).update(args)
    return config


def serve_config(base: dict[str, Any], layout: Layout, *, model: str | None = None,
                 device: str | None = None) -> dict[str, Any]:
    """`base` with the layout's arguments, and the model and the device where given (None keeps base's)."""
    args: dict[str, Any] = {"tensor_parallel_size": layout.tensor_parallel_size,
                            "pipeline_parallel_size": layout.pipeline_parallel_size,
                            "num_replicas": layout.num_replicas}
    if model is not None:
        args["model"] = model
    if device is not None:
        args["device"] = device
    return with_app_args(base, args)
