"""The API key, kept as its SHA-256 digest everywhere past the process that reads it.

`build_app` turns a key into its digest before anything is deployed, so the ingress
replicas' init arguments (shown by Serve's status, the dashboard and the controller's stored
config) hold no key; the ingress hashes each presented key and compares digests in constant
time. A Serve config YAML can name the digest alone (`api_key_sha256`, from
`printf %s "$KEY" | sha256sum`). API keys are random strings, so an unsalted digest reveals
nothing a guess could find.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path


def key_digest(key: str) -> str:
    """The hex SHA-256 of `key` (surrounding whitespace dropped, as a presented key's is)."""
    return hashlib.sha256(key.strip().encode()).hexdigest()


def read_key_file(path: str) -> str:
    """The key in `path` (its first line); ValueError for a missing or empty file."""
    try:
        key = Path(path).read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"api_key_file: cannot read {path}: {exc.strerror}") from None
    if not key or not key[0].strip():
        raise ValueError(f"api_key_file: {path} holds no key")
    return key[0].strip()


def check_digest(digest: str) -> str:
    """`digest` if it is a hex SHA-256 (64 hex digits, any case), lower-cased; else ValueError."""
    value = digest.strip().lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError("api_key_sha256: must be 64 hex digits (printf %s \"$KEY\" | sha256sum)")
    return value


def key_matches(presented: str, digest: str) -> bool:
    """Whether `presented` is the key of `digest`, compared in constant time."""
    return hmac.compare_digest(key_digest(presented).encode(), digest.encode())
