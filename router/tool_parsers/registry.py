"""The tool-call parsers a server may be configured with (`tool_call_parser`, vLLM's names)."""

from __future__ import annotations

from tandem.router.tool_parsers.call_stream import ToolParser
from tandem.router.tool_parsers.hermes import HERMES
from tandem.router.tool_parsers.llama3_json import LLAMA3_JSON
from tandem.router.tool_parsers.mistral import MISTRAL

TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL)}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError naming the option and the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"tool_call_parser: must be one of {', '.join(sorted(TOOL_PARSERS))}, "
                         f"got {name!r}") from None
