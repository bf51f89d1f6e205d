"""vLLM's `speculative_config` (one JSON object, `--speculative-config` and the Serve config's
`speculative_config`) turned into tandem's flat speculative options.

    {"model": "DIR", "num_speculative_tokens": 4}                   a draft model
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}

Keys tandem has no counterpart for (EAGLE heads, quantized drafts, token trees) are refused by
name, never ignored: the user would believe they speculate in a way they do not.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's key -> tandem's engine option.
KEYS = {
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_tensor_parallel_size": "speculative_draft_tensor_parallel_size",
    "prompt_lookup_max": "ngram_prompt_lookup_max",
    "prompt_lookup_min": "ngram_prompt_lookup_min",
    "disable_by_batch_size": "disable_batch_size",
    "dtype": "speculative_draft_dtype",  # tandem's: the draft's own precision
}
METHODS = ("ngram", "draft_model")


def speculative_options(value: str | dict[str, Any]) -> dict[str, Any]:
    """The engine options `value` (a JSON object or its text) sets; ValueError naming what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(KEYS) - {"method"})
    if unknown:
        raise ValueError(f"speculative_config: {', '.join(unknown)}: not supported by tandem "
                         f"(supported: method, {', '.join(KEYS)})")
    method = value.get("method", "ngram" if value.get("model") == "ngram" else "draft_model")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method: must be one of {', '.join(METHODS)}, got {method!r}")
    options = {KEYS[key]: item for key, item in value.items() if key != "method"}
    if method == "ngram":
        if options.get("speculative_model", "ngram") != "ngram":
            raise ValueError("speculative_config: method ngram takes no model")
        options["speculative_model"] = "ngram"
    elif not options.get("speculative_model"):
        raise ValueError("speculative_config: model: a draft model is required (or method: ngram)")
    if "num_speculative_tokens" not in options:
        raise ValueError("speculative_config: num_speculative_tokens: required")
    return options
