"""GpuScheduling: where the GPU worker pods may run (a node selector and the tolerations of
GPU nodes' taints). The head needs no GPU and keeps off GPU nodes by not tolerating them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.cli.k8s import parse_pair

EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Toleration:
    key: str
    effect: str
    value: str | None = None  # None: the taint's key is enough (operator Exists)

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("gpu toleration: the key is empty")
        if self.effect not in EFFECTS:
            raise ValueError(f"gpu toleration: effect must be one of {', '.join(EFFECTS)}, got {self.effect!r}")

    @classmethod
    def parse(cls, text: str) -> Toleration:
        """KEY[=VALUE]:EFFECT."""
        taint, sep, effect = text.rpartition(":")
        if not sep:
            raise ValueError(f"gpu toleration: expected KEY[=VALUE]:EFFECT, got {text!r}")
        key, _, value = taint.partition("=")
        return cls(key, effect, value or None)

    def flag(self) -> str:
        return f"{self.key}{'' if self.value is None else '=' + self.value}:{self.effect}"

    def spec(self) -> dict[str, Any]:
        if self.value is None:
            return {"key": self.key, "operator": "Exists", "effect": self.effect}
        return {"key": self.key, "operator": "Equal", "value": self.value, "effect": self.effect}


# The taint GPU node pools carry on the major clouds (GKE, AKS) and with NVIDIA's GPU operator.
DEFAULT_TOLERATIONS = (Toleration("nvidia.com/gpu", "NoSchedule"),)


@dataclass(frozen=True)
class GpuScheduling:
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = DEFAULT_TOLERATIONS

    @classmethod
    def parse(cls, node_selector: list[str] | None, tolerations: list[str] | None) -> GpuScheduling:
        """--gpu-node-selector KEY=VALUE and --gpu-toleration KEY[=VALUE]:EFFECT (given ones replace the default)."""
        pairs = tuple(parse_pair(text, "gpu node selector") for text in node_selector or ())
        if len({key for key, _ in pairs}) != len(pairs):
            raise ValueError(f"gpu node selector: a key is given twice: {node_selector}")
        parsed = tuple(Toleration.parse(text) for text in tolerations) if tolerations else DEFAULT_TOLERATIONS
        return cls(pairs, parsed)

    def flags(self) -> list[str]:
        flags = [f for key, value in self.node_selector for f in ("--gpu-node-selector", f"{key}={value}")]
        if self.tolerations != DEFAULT_TOLERATIONS:
            flags += [f for t in self.tolerations for f in ("--gpu-toleration", t.flag())]
        return flags

    def pod_spec(self) -> dict[str, Any]:
        """The worker pod spec's fields."""
        spec: dict[str, Any] = {}
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            spec["tolerations"] = [t.spec() for t in self.tolerations]
        return spec
