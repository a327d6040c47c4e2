"""A strict reading of JSON, written independently of the addon, to judge it.

``loads`` returns a value only for a text that every mainstream parser reads
the same way, and raises ``NotStrictJSON`` (saying why and where) for anything
else:

* duplicate keys at any depth, also when spelled differently (``"a"`` and
  ``"\\u0061"``): parsers keep the first, keep the last, or refuse;
* a lone surrogate, escaped (``"\\ud800"``) or encoded in the bytes: parsers
  refuse it, replace it with U+FFFD, or keep it;
* a byte order mark (RFC 8259: must not be sent; some parsers skip it, others
  refuse), bytes that are not UTF-8, ``NaN``/``Infinity``, anything else
  outside RFC 8259's grammar;
* a number a double cannot hold as written: overflow (``1e400``), underflow
  (``1e-400``), or more digits than its double keeps
  (``1.00000000000000000001``). Parsers that keep decimals and parsers that
  read doubles disagree on those. A float is accepted when its literal is
  numerically the shortest text of the double it rounds to, so both kinds of
  parser agree on it to the last digit;
* an integer of more than 4,300 digits, which the standard library and msgspec
  both refuse.

Choices, and why:

* Integers are kept exact at any size up to that limit, as the standard
  library and msgspec read them, so two integers equal under this reading are
  the same number. (A parser that reads only doubles rounds those beyond
  2**53; the addon never rewrites an item's digits, so an upstream sees the
  client's own.)
* ``-0`` reads as the integer 0. The standard library and msgspec read it so;
  JavaScript reads -0, which is ``=== 0`` and serialises back as ``0``: no
  mainstream parser gives it a meaning that differs from 0 when used or
  written back. A float negative zero (``-0.0``, ``-0e0``) stays ``-0.0``,
  as every parser keeps it, and ``first_difference`` tells it from ``0.0``.
* Nesting depth is unlimited (the reader is iterative). Parsers refuse
  different depths, but refusing is not reading differently, and a rewrite
  that keeps the client's item bytes keeps their depth.

``first_difference`` compares two values under this reading: types are never
mixed (``1``, ``1.0`` and ``True`` all differ), nor are the two zeros.

``members`` splits an object that is ambiguous as a whole into its top-level
members, so that the parts that matter (a request's ``input``, an answer's
``id``) can be read strictly on their own.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any

BOM = b"\xef\xbb\xbf"
MAX_INT_DIGITS = 4300
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"([^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*)"')
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|(.))")
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_LITERALS = (("true", True), ("false", False), ("null", None))
_LENIENT_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SCALAR_END = re.compile(r"[,}\]\s]")
_BRACKET_OR_QUOTE = re.compile(r'["{}\[\]]')


class NotStrictJSON(ValueError):
    """The text is not JSON, or mainstream parsers read it differently."""


def loads(data: bytes | str) -> Any:
    """The value of a JSON text that every mainstream parser reads the same way."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if data.startswith(BOM):
            raise NotStrictJSON("a byte order mark")
        try:
            text = data.decode("utf-8")  # strict: refuses encoded surrogates and overlong forms
        except UnicodeDecodeError as e:
            raise NotStrictJSON(f"not UTF-8 at byte {e.start}") from None
    else:
        text = data
        if text.startswith("\ufeff"):
            raise NotStrictJSON("a byte order mark")
    return _Reader(text).document()


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        # open containers, each with the key its next value goes to (None in a list)
        self.stack: list[tuple[dict | list, str | None]] = []

    def fail(self, why: str) -> NotStrictJSON:
        return NotStrictJSON(f"{why} at {self.where()} (char {self.pos})")

    def where(self) -> str:
        path = "$"
        for container, key in self.stack:
            path += f"[{len(container)}]" if isinstance(container, list) else f".{key}"
        return path

    def skip_whitespace(self) -> None:
        self.pos = _WHITESPACE.match(self.text, self.pos).end()

    def document(self) -> Any:
        self.skip_whitespace()
        value = self.value()
        self.skip_whitespace()
        if self.pos != len(self.text):
            raise self.fail("trailing characters")
        return value

    def value(self) -> Any:
        """One value; containers are read with an explicit stack, not recursion."""
        while True:
            opener = self.text[self.pos : self.pos + 1]
            if opener in ("{", "["):
                self.pos += 1
                self.skip_whitespace()
                closer = "}" if opener == "{" else "]"
                if self.text.startswith(closer, self.pos):
                    self.pos += 1
                    value: Any = {} if opener == "{" else []
                else:
                    container: dict | list = {} if opener == "{" else []
                    self.stack.append((container, None))
                    if isinstance(container, dict):
                        self.key()
                    continue
            else:
                value = self.scalar()
            while True:  # the value is complete: hand it to its container
                if not self.stack:
                    return value
                container, key = self.stack[-1]
                if isinstance(container, dict):
                    container[key] = value
                else:
                    container.append(value)
                self.skip_whitespace()
                separator = self.text[self.pos : self.pos + 1]
                self.pos += 1
                if separator == ",":
                    self.skip_whitespace()
                    if isinstance(container, dict):
                        self.key()
                    break
                if separator != ("}" if isinstance(container, dict) else "]"):
                    self.pos -= 1
                    raise self.fail("expected ',' or the container's end")
                self.stack.pop()
                value = container

    def key(self) -> None:
        """Read ``"key":`` of the innermost object; a key seen before is a duplicate."""
        container, _ = self.stack[-1]
        if not self.text.startswith('"', self.pos):
            raise self.fail("expected a key")
        key = self.string()
        if key in container:
            raise self.fail(f"duplicate key {key!r}")
        self.stack[-1] = (container, key)
        self.skip_whitespace()
        if not self.text.startswith(":", self.pos):
            raise self.fail("expected ':'")
        self.pos += 1
        self.skip_whitespace()

    def scalar(self) -> Any:
        char = self.text[self.pos : self.pos + 1]
        if char == '"':
            return self.string()
        if self.text.startswith(("NaN", "Infinity", "-Infinity"), self.pos):
            raise self.fail("NaN or Infinity, which JSON does not have")
        if char == "-" or char.isdigit():
            return self.number()
        for word, value in _LITERALS:
            if self.text.startswith(word, self.pos):
                self.pos += len(word)
                return value
        raise self.fail("expected a value")

    def string(self) -> str:
        match = _STRING.match(self.text, self.pos)
        if match is None:
            raise self.fail("a string with a control character, a bad escape, or no end")
        self.pos = match.end()
        text = match.group(1)
        if "\\" in text:
            text = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if m.group(1) else _SHORT_ESCAPES[m.group(2)], text)
            # An escaped pair becomes one character; what stays in the surrogate range is alone.
            text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
        if _SURROGATE.search(text):
            raise self.fail("a lone surrogate")
        return text

    def number(self) -> int | float:
        match = _NUMBER.match(self.text, self.pos)
        if match is None:
            raise self.fail("a malformed number")
        literal = match.group()
        if match.group(1) is None and match.group(2) is None:
            if len(literal.lstrip("-")) > MAX_INT_DIGITS:
                raise self.fail("an integer longer than parsers accept")
            self.pos = match.end()
            return int(literal)
        value = float(literal)
        if not math.isfinite(value) or Decimal(literal) != Decimal(repr(value)):
            raise self.fail(f"the number {_shorten(literal)} is not exact as a double")
        self.pos = match.end()
        return value


def _shorten(literal: str) -> str:
    return literal if len(literal) <= 40 else f"{literal[:20]}…{literal[-10:]}"


def first_difference(a: Any, b: Any) -> str | None:
    """Where two JSON values first differ under the strict reading (a path
    like ``$[3].content``), or None when they are the same. Iterative, so
    deep nesting is fine."""
    pending: list[tuple[str, Any, Any]] = [("$", a, b)]
    while pending:
        path, x, y = pending.pop()
        if type(x) is not type(y):
            return f"{path}: {type(x).__name__} vs {type(y).__name__}"
        if isinstance(x, float):
            if x != y or math.copysign(1.0, x) != math.copysign(1.0, y):
                return f"{path}: {x!r} vs {y!r}"
        elif isinstance(x, dict):
            if x.keys() != y.keys():
                return f"{path}: keys {sorted(x.keys() ^ y.keys())} on one side only"
            pending.extend((f"{path}.{k}", x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return f"{path}: {len(x)} vs {len(y)} elements"
            pending.extend((f"{path}[{i}]", v, w) for i, (v, w) in enumerate(zip(x, y)))
        elif x != y:
            return f"{path}: {_shorten(repr(x))} vs {_shorten(repr(y))}"
    return None


def members(data: bytes | str) -> list[tuple[str, str]]:
    """The top-level object's members as (key, value text), in order, duplicates
    kept. The scan is as lenient as Python's json (a BOM, encoded surrogates,
    any escape), so that each value text can be read with ``loads`` on its
    own. ValueError if the text is not an object Python's json would read."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data).removeprefix(BOM).decode("utf-8", "surrogatepass")
    scan = _Scan(data)
    scan.expect("{")
    found: list[tuple[str, str]] = []
    if scan.take("}"):
        return found
    while True:
        key = json.loads(scan.lenient_string())
        scan.expect(":")
        found.append((key, scan.value_text()))
        if scan.take("}"):
            return found
        scan.expect(",")


class _Scan:
    """Finds where values end, without judging them."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = _WHITESPACE.match(text).end()

    def take(self, char: str) -> bool:
        if self.text.startswith(char, self.pos):
            self.pos = _WHITESPACE.match(self.text, self.pos + 1).end()
            return True
        return False

    def expect(self, char: str) -> None:
        if not self.take(char):
            raise ValueError(f"expected {char!r} at char {self.pos}")

    def lenient_string(self) -> str:
        start, self.pos = self.pos, self.lenient_string_end()
        text = self.text[start : self.pos]
        self.pos = _WHITESPACE.match(self.text, self.pos).end()
        return text

    def value_text(self) -> str:
        start, depth = self.pos, 0
        while True:
            char = self.text[self.pos : self.pos + 1]
            if char == '"':
                self.pos = self.lenient_string_end()
            elif char and char in "{[":
                depth += 1
                self.pos += 1
            elif char and char in "}]" and depth:
                depth -= 1
                self.pos += 1
            elif depth:
                following = _BRACKET_OR_QUOTE.search(self.text, self.pos)
                if following is None:
                    raise ValueError("an unclosed container")
                self.pos = following.start()
            else:
                end = _SCALAR_END.search(self.text, self.pos)
                self.pos = end.start() if end else len(self.text)
                if self.pos == start:
                    raise ValueError(f"expected a value at char {start}")
            if not depth:
                break
        value = self.text[start : self.pos]
        self.pos = _WHITESPACE.match(self.text, self.pos).end()
        return value

    def lenient_string_end(self) -> int:
        match = _LENIENT_STRING.match(self.text, self.pos)
        if match is None:
            raise ValueError(f"an unterminated string at char {self.pos}")
        return match.end()
