"""Request fields tandem refuses by name, and fields no API defines (ignored, with a log line).

A server that skips a field it was sent answers 200 with something other than what was asked,
and the client's code breaks far from the cause. So every field of OpenAI's Completions and
Chat Completions requests is either honoured (protocol.py) or refused here with a 400 that
names it, as are vLLM's extensions that would change the output. A field sent with the value
that asks for nothing (`store: false`, `service_tier: "auto"`, `modalities: ["text"]`) is
accepted: tandem does that anyway.

A field that neither API defines is ignored, as vLLM ignores it, with one log line per request
naming it (`unknown_fields`): an operator sees what clients send that nothing reads.

Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, `functions`, `function_call`) is not
refused here: the chat request model honours it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tandem.router.protocol import OpenAIError


@dataclass(frozen=True)
class Unsupported:
    why: str  # what tandem does instead, for the client
    accepts: tuple[Any, ...] = (None,)  # values that ask for nothing (None: the field sent as null)

    def refuses(self, value: Any) -> bool:
        # By type as well as value: 0 is not false, and 1 is not true.
        return not any(type(value) is type(ok) and value == ok for ok in self.accepts)


MAX_LOGGED_NAMES = 16  # unknown fields named in one log line
MAX_LOGGED_CHARS = 64
_NO_STORE = "tandem stores no completions"
UNSUPPORTED: dict[str, Unsupported] = {
    # OpenAI's Chat Completions
    "audio": Unsupported("tandem answers in text only"),
    "modalities": Unsupported("tandem answers in text only: send [\"text\"] or nothing", (None, ["text"])),
    "prediction": Unsupported("predicted outputs are not supported"),
    "reasoning_effort": Unsupported("tandem has no reasoning-effort control"),
    "verbosity": Unsupported("tandem has no verbosity control"),
    "service_tier": Unsupported("tandem has one service tier: send \"auto\", \"default\" or nothing",
                                (None, "auto", "default")),
    "store": Unsupported(f"{_NO_STORE}: send false or nothing", (None, False)),
    "metadata": Unsupported(f"{_NO_STORE} to tag", (None, {})),
    "web_search_options": Unsupported("tandem has no web search"),
    "moderation": Unsupported("tandem runs no moderation"),
    "prompt_cache_key": Unsupported("tandem routes by the prompt's cached prefix itself and takes no cache key"),
    "prompt_cache_options": Unsupported("tandem's prefix cache has no per-request options"),
    "prompt_cache_retention": Unsupported("tandem's prefix cache has no per-request retention"),
    "safety_identifier": Unsupported("tandem keeps no per-user safety records"),
    # OpenAI's Completions
    "suffix": Unsupported("tandem does not insert text (no fill-in-the-middle)", (None, "")),
    # vLLM's extensions that tandem does not do
    "use_beam_search": Unsupported("tandem has no beam search", (None, False)),
    "length_penalty": Unsupported("tandem has no beam search", (None, 1.0, 1)),
    "prompt_logprobs": Unsupported("prompt logprobs come with echo and logprobs on /v1/completions"),
    "allowed_token_ids": Unsupported("use logit_bias or structured_outputs.choice"),
    "bad_words": Unsupported("tandem has no bad-words filter", (None, [])),
    "truncate_prompt_tokens": Unsupported("tandem never truncates a prompt: one too long is refused"),
    "truncation_side": Unsupported("tandem never truncates a prompt"),
    "logits_processors": Unsupported("tandem takes no custom logits processors"),
    "priority": Unsupported("tandem has no request priorities", (None, 0)),
    "spaces_between_special_tokens": Unsupported("tandem always decodes with spaces between special tokens",
                                                 (None, True)),
    "add_generation_prompt": Unsupported("the chat template always adds the generation prompt", (None, True)),
    "continue_final_message": Unsupported("tandem cannot continue a final message", (None, False)),
    "chat_template": Unsupported("tandem uses the model's own chat template"),
    "chat_template_kwargs": Unsupported("tandem passes no arguments to the chat template", (None, {})),
    "documents": Unsupported("tandem passes no documents to the chat template"),
    "mm_processor_kwargs": Unsupported("tandem serves text only"),
    "media_io_kwargs": Unsupported("tandem serves text only"),
    "return_tokens_as_token_ids": Unsupported("tandem returns tokens as text", (None, False)),
    "return_token_ids": Unsupported("token ids come back over the gRPC API", (None, False)),
    "logprob_token_ids": Unsupported("tandem returns the top alternatives only"),
    "cache_salt": Unsupported("tandem's prefix cache takes no salt"),
    "kv_transfer_params": Unsupported("tandem moves KV between its groups itself"),
    "vllm_xargs": Unsupported("tandem takes no extension arguments"),
    "thinking_token_budget": Unsupported("tandem has no thinking budget"),
    "repetition_detection": Unsupported("tandem has no repetition detection"),
    "structural_tag": Unsupported("tandem takes json, regex, choice, grammar or json_object"),
}


def refuse_unsupported(body: dict[str, Any], model: type[BaseModel]) -> None:
    """An OpenAIError (400, naming the field) for the first field of `body` tandem does not do;
    a field `model` reads is never refused (/tokenize takes add_generation_prompt, say)."""
    own = _fields(model)
    for name, value in body.items():  # the client's order: the first it sent is named
        rule = UNSUPPORTED.get(name)
        if rule is not None and name not in own and rule.refuses(value):
            raise OpenAIError(400, f"{name}: not supported: {rule.why}", param=name, code="unsupported_parameter")


def unknown_fields(body: dict[str, Any], model: type[BaseModel]) -> list[str]:
    """The fields of `body` that `model` neither reads nor refuses, sorted."""
    return sorted(body.keys() - _fields(model) - UNSUPPORTED.keys())


def log_names(names: list[str]) -> str:
    """`names` for one log line: a body's keys are the client's text, so one with a line break
    or of a megabyte is quoted and cut, and past `MAX_LOGGED_NAMES` only their count is said."""
    shown = [_log_name(n) for n in names[:MAX_LOGGED_NAMES]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _log_name(name: str) -> str:
    if name.isprintable() and len(name) <= MAX_LOGGED_CHARS:
        return name
    return repr(name[:MAX_LOGGED_CHARS]) + ("..." if len(name) > MAX_LOGGED_CHARS else "")


@functools.cache
def _fields(model: type[BaseModel]) -> frozenset[str]:
    """The names a request model reads (its aliases where it has them)."""
    return frozenset(info.alias or name for name, info in model.model_fields.items())
