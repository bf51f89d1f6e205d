"""CallScanner: one tool call's JSON object, read a character at a time.

A call is `{"name": "...", "arguments": {...}}` ("parameters" in Llama 3's form and in a forced
call's schema); other keys are ignored, and a call without arguments has `{}`. The scanner checks
the JSON as it grows, so its caller knows after every character whether the text can still be a
call, the name as soon as its string closes, and where the arguments' raw text starts and ends:
a stream sends the arguments as the model wrote them, a piece at a time, never re-encoded.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\n\r"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'
_DIGITS = "0123456789"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# What may follow the characters of a number so far; the states where it may end.
_NUMBER_ENDS = ("zero", "int", "frac", "exp")

# What the next character may be.
_VALUE = 0  # a value (whitespace first)
_FIRST_KEY = 1  # just after "{": a key or "}"
_KEY = 2  # after ",": a key
_COLON = 3
_AFTER = 4  # after a value: "," or the container's end
_STRING = 5
_ESCAPE = 6
_UNICODE = 7
_NUMBER = 8
_LITERAL = 9
_FIRST_ITEM = 10  # just after "[": a value or "]"


class CallScanner:
    """Feed it the call's characters with `push`, from its opening "{"; stop once `done` or
    `error` is set. Offsets are relative to the call's first character."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.done = False
        self.name: str | None = None
        self.args_start: int | None = None  # the arguments' first character ("{")
        self.args_end: int | None = None  # one past their last ("}")
        self._pos = 0
        self._stack: list[str] = []  # "{" / "[" of the open containers
        self._mode = _VALUE
        self._string_is_key = False
        self._unicode_left = 0
        self._number = ""  # the number's state
        self._literal = ""  # the literal's characters still to come
        self._raw: list[str] | None = None  # a depth-1 key's or the name's characters, as written
        self._key: str | None = None  # the call object's key whose value comes next
        self._value_key: str | None = None  # the key of the call object's value being read
        self._seen: set[str] = set()

    @property
    def in_arguments(self) -> bool:
        """The arguments have started and not yet ended."""
        return self.args_start is not None and self.args_end is None

    def push(self, ch: str) -> bool:
        """Take one character; False (and `error` set) when the text can no longer be a call."""
        if self.done or self.error is not None:
            self._fail("text after the call's end")
            return False
        self._take(ch)
        self._pos += 1
        return self.error is None

    # ---- the JSON automaton --------------------------------------------------------------------
    def _take(self, ch: str) -> None:
        mode = self._mode
        if mode == _STRING:
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self._mode = _ESCAPE
                self._record(ch)
            elif ch < " ":
                self._fail("a control character inside a string")
            else:
                self._record(ch)
        elif mode == _ESCAPE:
            if ch not in _ESCAPES:
                self._fail(f"a bad escape \\{ch}")
                return
            self._record(ch)
            if ch == "u":
                self._mode, self._unicode_left = _UNICODE, 4
            else:
                self._mode = _STRING
        elif mode == _UNICODE:
            if ch not in _HEX:
                self._fail("a bad \\u escape")
                return
            self._record(ch)
            self._unicode_left -= 1
            if not self._unicode_left:
                self._mode = _STRING
        elif mode == _NUMBER:
            if not self._number_char(ch):
                if self._number not in _NUMBER_ENDS:
                    self._fail("an incomplete number")
                    return
                self._end_value()
                if self.error is None:
                    self._take(ch)  # the character after the number, read as what follows a value
        elif mode == _LITERAL:
            if ch != self._literal[0]:
                self._fail("a misspelt true, false or null")
                return
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value()
        elif ch in WHITESPACE:
            return
        elif mode == _VALUE:
            self._start_value(ch)
        elif mode == _FIRST_ITEM:
            if ch == "]":
                self._close(ch)
            else:
                self._start_value(ch)
        elif mode in (_FIRST_KEY, _KEY):
            if ch == '"':
                self._mode, self._string_is_key = _STRING, True
                self._raw = [] if len(self._stack) == 1 else None
            elif ch == "}" and mode == _FIRST_KEY:
                self._close(ch)
            else:
                self._fail("a key expected")
        elif mode == _COLON:
            if ch == ":":
                self._mode = _VALUE
            else:
                self._fail("':' expected")
        elif mode == _AFTER:
            top = self._stack[-1]
            if ch == ",":
                self._mode = _KEY if top == "{" else _VALUE
            elif ch in "}]":
                self._close(ch)
            else:
                self._fail("',' or the end of an object or array expected")

    def _start_value(self, ch: str) -> None:
        depth = len(self._stack)
        if depth == 0 and ch != "{":
            self._fail("a call is a JSON object")
            return
        if depth == 1:
            self._value_key = self._key
            if self._value_key == "name":
                if ch != '"':
                    self._fail("the name must be a string")
                    return
            elif self._value_key in ARGUMENT_KEYS:
                if ch != "{":
                    self._fail("the arguments must be a JSON object")
                    return
                self.args_start = self._pos
        if ch in "{[":
            self._stack.append(ch)
            self._mode = _FIRST_KEY if ch == "{" else _FIRST_ITEM
        elif ch == '"':
            self._mode, self._string_is_key = _STRING, False
            self._raw = [] if depth == 1 and self._value_key == "name" else None
        elif ch == "-" or ch in _DIGITS:
            self._mode = _NUMBER
            self._number = "sign" if ch == "-" else "zero" if ch == "0" else "int"
        elif ch in _LITERALS:
            self._mode, self._literal = _LITERAL, _LITERALS[ch]
        else:
            self._fail(f"a value expected, got {ch!r}")

    def _number_char(self, ch: str) -> bool:
        state = self._number
        if ch in _DIGITS:
            self._number = {"sign": "int" if ch != "0" else "zero", "zero": "", "int": "int", "dot": "frac",
                            "frac": "frac", "e": "exp", "esign": "exp", "exp": "exp"}[state]
            if not self._number:
                self._fail("a leading zero")
            return True
        if ch == "." and state in ("zero", "int"):
            self._number = "dot"
            return True
        if ch in "eE" and state in ("zero", "int", "frac"):
            self._number = "e"
            return True
        if ch in "+-" and state == "e":
            self._number = "esign"
            return True
        return False

    def _record(self, ch: str) -> None:
        if self._raw is not None:
            self._raw.append(ch)

    def _end_string(self) -> None:
        raw, self._raw = self._raw, None
        if self._string_is_key:
            self._mode = _COLON
            if raw is not None:  # a key of the call object itself
                self._key = json.loads('"' + "".join(raw) + '"')
                if self._key in self._seen and (self._key == "name" or self._key in ARGUMENT_KEYS):
                    self._fail(f"{self._key!r} given twice")
                    return
                self._seen.add(self._key)
                if self._key in ARGUMENT_KEYS and self.args_start is not None:
                    self._fail("arguments given twice")
            return
        if raw is not None:
            self.name = json.loads('"' + "".join(raw) + '"')
        self._end_value()

    def _close(self, ch: str) -> None:
        opener = "{" if ch == "}" else "["
        if self._stack[-1] != opener:
            self._fail(f"a stray {ch!r}")
            return
        self._stack.pop()
        if not self._stack:
            if self.name is None:
                self._fail("a call without a name")
                return
            self.done = True
            return
        if len(self._stack) == 1 and self._value_key in ARGUMENT_KEYS and self.args_end is None \
                and self.args_start is not None:
            self.args_end = self._pos + 1
        self._end_value()

    def _end_value(self) -> None:
        self._mode = _AFTER
        if len(self._stack) == 1:
            self._value_key = None

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
