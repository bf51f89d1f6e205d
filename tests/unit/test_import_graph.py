"""The import direction between the top-level folders, and between the layers of `workers/`.

    cli/ ──> router/ ──> workers/ ──> cluster/
      └────> bench/ ───────^

Only the CLI reaches bench; bench never imports the router (the CLI hands it `RouterHooks`).
Inside `workers/`, each subpackage (or top-level module) sits on a layer and imports only
itself and the layers below it, so no two of them can import each other in a circle.
Every import counts, including ones inside functions or under TYPE_CHECKING, and module
names in strings.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "router", "bench", "cli")
ALLOWED = {
    "cluster": set(),
    "workers": {"cluster"},
    "router": {"workers", "cluster"},
    "bench": {"workers", "cluster"},
    "cli": {"router", "workers", "cluster", "bench"},
}
# workers/ from the bottom up: a unit is a subpackage, or a module at the top of workers/.
WORKER_LAYERS = (
    ("speculative_config",),  # vLLM's speculative_config JSON, read into the options below
    ("config",),  # the engine's options
    # device fast paths and process-level helpers
    ("kernels", "startup_heap", "young_generation", "device_peaks", "cache_dir"),
    ("device_specs",),  # a device's datasheet figures, or this machine's probed ones
    ("distributed",),  # process groups and collectives
    ("quant",),  # quantized weights: schemes, scales, the 8-bit products
    ("structured",),  # grammars of structured outputs, and their token masks
    ("core",),  # requests, scheduler, KV blocks (no torch)
    ("text",),  # tokens to text
    ("model",),  # the model code
    ("sample",),  # logits to tokens
    ("runner",),  # one step on one device
    ("executor",),  # where the ranks run: this process or Ray workers
    ("spec",),  # drafting
    ("engine",),  # the engine, its builder, its async front
    ("serving",),  # the group's side of the Serve application
    ("llm",),  # the offline API
    ("__init__",),  # the public names
)
_MODULE = re.compile(r"^tandem\.(cluster|workers|router|bench|cli)(?:\.(\w+))?")


def _imported_modules(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("tandem...") and the like
        found.update(name for name in names if _MODULE.match(name))
    return found


def _sources(package: str) -> list[pathlib.Path]:
    return [p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def _edges() -> dict[str, set[tuple[str, str]]]:
    """package -> {(file, imported package)} for imports that leave the package."""
    edges: dict[str, set[tuple[str, str]]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path in _sources(package):
            for name in _imported_modules(path):
                imported = _MODULE.match(name).group(1)
                if imported != package:
                    edges[package].add((str(path.relative_to(ROOT)), imported))
    return edges


def _worker_unit(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT / "workers")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_imports_follow_the_layering() -> None:
    bad = sorted((src, dst) for package, pairs in _edges().items() for src, dst in pairs
                 if dst not in ALLOWED[package])
    assert bad == []


def test_only_the_cli_reaches_bench() -> None:
    into_bench = sorted({src.split("/")[0] for package, pairs in _edges().items() for src, dst in pairs
                         if dst == "bench"})
    assert into_bench == ["cli"]


def test_every_worker_unit_has_a_layer() -> None:
    layered = {unit for layer in WORKER_LAYERS for unit in layer}
    assert sorted({_worker_unit(p) for p in _sources("workers")} - layered) == []


def test_workers_layers_import_only_downwards() -> None:
    """A unit imports itself and lower layers only (never one beside it or above it)."""
    rank = {unit: i for i, layer in enumerate(WORKER_LAYERS) for unit in layer}
    bad = []
    for path in _sources("workers"):
        unit = _worker_unit(path)
        for name in _imported_modules(path):
            match = _MODULE.match(name)
            if match.group(1) != "workers" or match.group(2) is None:
                continue
            target = match.group(2)
            if target in rank and target != unit and rank[target] >= rank[unit]:
                bad.append(f"{path.relative_to(ROOT)} ({unit}) -> {target}")
    assert sorted(set(bad)) == []
