"""CallStream: a model's output, as its text arrives, split into content and tool calls.

Each family writes its calls its own way; a `CallSyntax` says where calls begin (a marker such as
`<tool_call>`, or the output's start) and what may stand between them, and this one machine reads
every family (hermes.py, llama3_json.py, mistral.py, and forced.py for a call the server forces):

- Text is content until a marker opens calls. Content that may be the start of a marker is held
  back until the following text says which it is, so no text of a call is ever sent as content.
- A call is sent once its name is known: `CallStart` (its index and name), then its arguments'
  raw text in `CallArguments` pieces as they grow (call_scanner.py checks the JSON on the way).
- A malformed call (bad JSON, no name, arguments that are not an object, the output ending
  inside it) falls back to content: its text not yet sent, and all that follows (what comes after
  a broken call is not trusted to be one). A call whose start a stream has sent cannot be taken
  back: there the content starts where the stream stood. Read whole (`parse`), nothing is sent
  before the end, so a malformed call is all content.
- Between calls, whitespace and the family's separators are dropped; any other text ends the
  calls and is content again (later markers open calls again).

A stream gives the same content and calls however its text is cut into deltas, except that a
call it has started stays a call.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tandem.router.tool_parsers.call_scanner import WHITESPACE, CallScanner

WS = "\x00ws"  # a step: any whitespace
CALL = "\x00call"  # a step: a call's opening "{"; as a key of a state, a "{" there opens a call
Steps = tuple[str, ...]  # literals, WS and CALL, in order; each sequence ends with CALL
Target = Steps | str  # what a literal between calls leads to: steps, or the name of a state

_CONTENT, _STEPS, _CALL, _BETWEEN, _PLAIN = range(5)
_AFTER_CALL = "after_call"
# Text already sent (as content or a call) is dropped from the stream's buffer once it is this
# long: appending to one growing string copies it whole, so a long answer read with tools
# offered would cost the ingress's loop time quadratic in its length.
_TRIM_CHARS = 4096


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes its calls."""

    openers: Mapping[str, Steps]  # in content: a marker -> the steps that follow it
    after_call: Mapping[str, Target]  # just after a call: a literal -> steps, or a state
    states: Mapping[str, Mapping[str, Target]] = field(default_factory=dict)  # other states between calls
    leading: Steps = ()  # steps tried where the output starts (calls written with no marker)


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it


def collect(events: list[Event]) -> tuple[str, list[ParsedCall]]:
    """The content and the calls that `events` make, in order."""
    content: list[str] = []
    calls: dict[int, ParsedCall] = {}
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls[event.index] = ParsedCall(event.name, "")
        else:
            calls[event.index].arguments += event.text
    return "".join(content), [calls[i] for i in sorted(calls)]


class CallStream:
    def __init__(self, syntax: CallSyntax) -> None:
        self._syntax = syntax
        self._markers = tuple(syntax.openers)
        self._first_chars = "".join(sorted({m[0] for m in self._markers}))
        self._text = ""
        self._pos = 0  # the next character to read
        self._committed = 0  # everything before it is sent (as content or a call) or dropped
        self._mode = _STEPS if syntax.leading else _CONTENT
        self._steps: Steps = syntax.leading
        self._matched = 0  # characters of the current literal step matched
        self._soft = bool(syntax.leading)  # leading steps not yet matched: a mismatch is plain content
        self._between: Mapping[str, Target] = syntax.after_call
        self._scanner: CallScanner | None = None
        self._call_at = 0  # where the current call's "{" is
        self._index: int | None = None  # the current call's index, once its start is sent
        self._num_calls = 0
        self._args_sent = 0  # the current call's arguments are sent up to here
        self._events: list[Event] = []

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return self._num_calls

    def feed(self, text: str) -> list[Event]:
        """What `text`, the output's next piece, lets the stream send now."""
        self._text += text
        self._run()
        self._flush()
        self._trim()
        return self._take()

    def finish(self, text: str = "") -> list[Event]:
        """The output ended with `text`: what is held back is sent, and a call left open falls back
        to content (as `text` is read with the end, a call it completes or breaks was not sent)."""
        self._text += text
        self._run()
        if self._mode == _BETWEEN:
            held = self._text[self._committed:]
            if held.strip(WHITESPACE):  # a separator cut short: text, not markup
                self._content(held)
            self._committed = len(self._text)
        elif self._mode == _CALL or (self._mode == _STEPS and not self._soft):
            self._fail()
        else:  # content, or leading steps that matched nothing
            self._mode = _PLAIN
        self._flush()
        return self._take()

    # ---- reading -------------------------------------------------------------------------------
    def _run(self) -> None:
        """Read as far as the text allows: to its end, or to a piece that only more text decides."""
        while self._pos < len(self._text):
            mode = self._mode
            if mode == _CONTENT:
                if not self._read_content():
                    return
            elif mode == _STEPS:
                self._read_step()
            elif mode == _CALL:
                self._read_call()
            elif mode == _BETWEEN:
                if not self._read_between():
                    return
            else:
                self._pos = len(self._text)

    def _read_content(self) -> bool:
        text, pos = self._text, self._pos
        starts = [i for i in (text.find(c, pos) for c in self._first_chars) if i >= 0]
        if not starts:
            self._pos = len(text)
            return True
        i = min(starts)
        marker = next((m for m in self._markers if text.startswith(m, i)), None)
        if marker is not None:
            self._content(text[self._committed:i])
            self._committed = i
            self._pos = i + len(marker)
            self._enter_steps(self._syntax.openers[marker])
            return True
        if any(m.startswith(text[i:]) for m in self._markers):
            self._pos = i  # maybe a marker's start: the next text decides
            return False
        self._pos = i + 1
        return True

    def _read_step(self) -> None:
        step, ch = self._steps[0], self._text[self._pos]
        if step == WS:
            if ch in WHITESPACE:
                self._pos += 1
            else:
                self._steps = self._steps[1:]
        elif step == CALL:
            if ch == "{":
                self._start_call()
            else:
                self._mismatch()
        elif ch == step[self._matched]:
            self._pos += 1
            self._matched += 1
            self._soft = False
            if self._matched == len(step):
                self._steps, self._matched = self._steps[1:], 0
        else:
            self._mismatch()

    def _read_call(self) -> None:
        scanner, text = self._scanner, self._text
        assert scanner is not None
        while self._pos < len(text):
            ok = scanner.push(text[self._pos])
            self._pos += 1
            if not ok:
                self._fail()
                return
            if scanner.done:
                self._end_call()
                return

    def _read_between(self) -> bool:
        text, pos, between = self._text, self._pos, self._between
        ch = text[pos]
        if ch in WHITESPACE:
            self._pos += 1
            return True
        if ch == "{" and CALL in between:
            self._start_call()
            return True
        literals = [lit for lit in between if lit != CALL]
        literal = next((lit for lit in literals if text.startswith(lit, pos)), None)
        if literal is None:
            if any(lit.startswith(text[pos:]) for lit in literals):
                return False  # maybe a separator's start: the next text decides
            self._mode, self._pos = _CONTENT, self._committed  # the calls end: the held text is content
            return True
        self._pos = pos + len(literal)
        target = between[literal]
        if isinstance(target, str):  # markup that closes something: dropped
            self._committed = self._pos
            self._between = self._syntax.after_call if target == _AFTER_CALL else self._syntax.states[target]
        else:
            self._enter_steps(target)
        return True

    # ---- transitions ---------------------------------------------------------------------------
    def _enter_steps(self, steps: Steps) -> None:
        self._mode, self._steps, self._matched, self._soft = _STEPS, steps, 0, False

    def _mismatch(self) -> None:
        if self._soft:  # the output does not start with calls: it is content
            self._mode, self._pos, self._soft = _CONTENT, self._committed, False
        else:
            self._fail()

    def _start_call(self) -> None:
        self._mode, self._soft = _CALL, False
        self._scanner = CallScanner()
        self._call_at = self._pos
        self._index = None
        self._args_sent = 0

    def _end_call(self) -> None:
        scanner = self._scanner
        assert scanner is not None
        self._send_call(self._pos)
        if scanner.args_start is None:  # a call without arguments takes none
            self._events.append(CallArguments(self._index, "{}"))
        self._committed = self._pos
        self._scanner = None
        self._mode, self._between = _BETWEEN, self._syntax.after_call

    def _fail(self) -> None:
        """A malformed call: from what is not yet sent on, all is content."""
        self._mode, self._scanner, self._pos = _PLAIN, None, len(self._text)

    # ---- sending -------------------------------------------------------------------------------
    def _flush(self) -> None:
        mode = self._mode
        if mode == _CONTENT:
            self._content(self._text[self._committed:self._pos])
            self._committed = self._pos
        elif mode == _PLAIN:
            self._content(self._text[self._committed:])
            self._committed = len(self._text)
        elif mode == _CALL and self._scanner is not None and self._scanner.name is not None:
            self._send_call(self._pos)
            self._committed = self._pos  # started: a later failure cannot take it back

    def _send_call(self, upto: int) -> None:
        """The current call's start (once) and its arguments up to `upto` (or their end)."""
        scanner = self._scanner
        assert scanner is not None and scanner.name is not None
        if self._index is None:
            self._index = self._num_calls
            self._num_calls += 1
            self._events.append(CallStart(self._index, scanner.name))
        if scanner.args_start is None:
            return
        start = max(self._args_sent, self._call_at + scanner.args_start)
        end = self._call_at + scanner.args_end if scanner.args_end is not None else upto
        if end > start:
            self._events.append(CallArguments(self._index, self._text[start:end]))
            self._args_sent = end

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], Content):
            self._events[-1] = Content(self._events[-1].text + text)
        else:
            self._events.append(Content(text))

    def _trim(self) -> None:
        """Drop the sent text nothing reads again: before `_committed` (a mismatch or a failed
        call goes back no further) and, in a call, before its "{" (its arguments are sliced
        from there). Every position counts from the buffer's start, so each moves with it."""
        cut = min(self._committed, self._call_at) if self._mode == _CALL else self._committed
        if cut > _TRIM_CHARS:
            self._text = self._text[cut:]
            self._pos -= cut
            self._committed -= cut
            self._call_at -= cut
            self._args_sent -= cut

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def openai_call_id() -> str:
    """An id in OpenAI's form: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolParser:
    """A family's parser: `parse` for a whole output, `stream` for one read as it comes."""

    name: str
    syntax: CallSyntax
    new_call_id: Callable[[], str] = openai_call_id

    @property
    def markers(self) -> tuple[str, ...]:
        """Texts the model must be able to write: the tokenizer must not drop them as special."""
        literals = {lit for state in (self.syntax.openers, self.syntax.after_call, *self.syntax.states.values())
                    for lit in state if lit != CALL}
        return tuple(sorted(lit for lit in literals if len(lit) > 1))

    def stream(self) -> CallStream:
        return CallStream(self.syntax)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole output; content is None when there are calls and no text."""
        content, calls = collect(self.stream().finish(text))
        return (content or None) if calls else content, calls
