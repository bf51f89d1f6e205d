"""Small Kubernetes pieces the manifests share: a key of a Secret, and the env entries and
labels built from plain values."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# A Secret's or a claim's name (a DNS subdomain) and a Secret's key, as Kubernetes accepts them.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")


def check_name(what: str, name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what}: {name!r} is not a Kubernetes object name (lower-case letters, digits, '-', '.')")
    return name


@dataclass(frozen=True)
class SecretRef:
    """One key of a Secret in the manifest's namespace."""

    name: str
    key: str

    def __post_init__(self) -> None:
        check_name("secret", self.name)
        if not _KEY.fullmatch(self.key):
            raise ValueError(f"secret key: {self.key!r} is not a Secret key (letters, digits, '-', '_', '.')")

    @classmethod
    def parse(cls, text: str, default_key: str) -> SecretRef:
        """NAME or NAME:KEY."""
        name, _, key = text.partition(":")
        return cls(name, key or default_key)

    def flag(self, default_key: str) -> str:
        return self.name if self.key == default_key else f"{self.name}:{self.key}"

    def value_from(self) -> dict[str, Any]:
        return {"valueFrom": {"secretKeyRef": {"name": self.name, "key": self.key}}}

    def env(self, variable: str) -> dict[str, Any]:
        return {"name": variable, **self.value_from()}


def parse_pair(text: str, what: str) -> tuple[str, str]:
    """KEY=VALUE, both non-empty."""
    key, sep, value = text.partition("=")
    if not (sep and key and value):
        raise ValueError(f"{what}: expected KEY=VALUE, got {text!r}")
    return key, value
