"""Write JSON the way odd clients and servers do: every byte a choice.

``write(value, style)`` spells a value with the style's whitespace, string
escapes, number spellings and key order, all of which keep its meaning. The
nodes below write what no serializer would, on purpose: ``Pairs`` keeps
duplicate keys in the order given, ``Verbatim`` puts bytes in as they are
(``1e400``, ``NaN``), ``Nested`` nests a value thousands deep without
recursion. A string with a lone surrogate is written as its escape, or as its
encoded bytes when the style writes characters raw.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

# Characters each spelled differently by the escape styles: quote, backslash,
# slash, controls, non-ASCII, astral (a surrogate pair when escaped), U+2028.
SPECIAL_TEXT = 'q"b\\s/\n\t\x00\x7fé中😀\u2028'
ESCAPES = ("raw", "ascii", "every", "mixed")
BIG_STRING = 10_000  # longer strings are written raw or with only non-ASCII escaped (fast paths)
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# What a big string's fast path must still write one by one, per mode.
_SPECIAL = {"raw": re.compile(r'["\\\x00-\x1f]'), "ascii": re.compile(r'["\\/\x00-\x1f\x7f-\U0010ffff]')}


@dataclass(frozen=True)
class Pairs:
    """An object written key by key, in this order, duplicates kept."""

    pairs: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Verbatim:
    """Bytes written exactly as given (a literal no serializer writes)."""

    text: bytes


@dataclass(frozen=True)
class Nested:
    """``leaf`` inside ``depth`` single-element lists."""

    depth: int
    leaf: Any


@dataclass
class Style:
    """How one body is spelled; ``seed`` drives the per-token choices."""

    spaces: tuple[str, ...]  # whitespace pieces, one chosen between any two tokens
    escapes: str  # raw | ascii (non-ASCII escaped) | every (every character escaped) | mixed
    spell_numbers: bool  # -0 for 0, floats in exponent forms and padded
    key_order: str  # kept | reversed | shuffled
    seed: int
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def space(self) -> str:
        return self.rng.choice(self.spaces)


PLAIN = Style(("",), "raw", False, "kept", 0)


def write(value: Any, style: Style = PLAIN, bom: bool = False) -> bytes:
    text = style.space() + _write(value, style) + style.space()
    return (b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8", "surrogatepass")


def _write(value: Any, style: Style) -> str:
    if isinstance(value, Verbatim):
        return value.text.decode("utf-8", "surrogatepass")
    if isinstance(value, Nested):
        return "[" * value.depth + _write(value.leaf, style) + "]" * value.depth
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return "-0" if value == 0 and style.spell_numbers and style.rng.random() < 0.5 else str(value)
    if isinstance(value, float):
        return _float(value, style)
    if isinstance(value, str):
        return _string(value, style)
    if isinstance(value, list):
        return _container("[", [_write(v, style) for v in value], "]", style)
    if isinstance(value, dict):
        pairs = list(value.items())
        if style.key_order == "reversed":
            pairs.reverse()
        elif style.key_order == "shuffled":
            style.rng.shuffle(pairs)
        value = Pairs(tuple(pairs))
    if isinstance(value, Pairs):
        members = [_string(k, style) + style.space() + ":" + style.space() + _write(v, style) for k, v in value.pairs]
        return _container("{", members, "}", style)
    raise TypeError(f"cannot write {type(value).__name__}")


def _container(opener: str, members: list[str], closer: str, style: Style) -> str:
    if not members:
        return opener + style.space() + closer
    body = members[0] + "".join(style.space() + "," + style.space() + m for m in members[1:])
    return opener + style.space() + body + style.space() + closer


def _float(value: float, style: Style) -> str:
    """The shortest text of the double, or another spelling of exactly the
    same number (always a float: with a point or an exponent)."""
    shortest = repr(value)
    if not style.spell_numbers:
        return shortest
    sign, digits, exponent = Decimal(shortest).as_tuple()
    mantissa = "".join(map(str, digits))
    minus = "-" if sign else ""
    return style.rng.choice([
        shortest,
        f"{minus}{mantissa[0]}.{mantissa[1:] or '0'}E{exponent + len(mantissa) - 1:+d}",
        f"{minus}{mantissa}e{exponent}",
        f"{minus}0.{mantissa}000e{exponent + len(mantissa)}",
    ])


def _string(text: str, style: Style) -> str:
    if len(text) > BIG_STRING:
        mode = "raw" if style.escapes == "raw" else "ascii"
        return '"' + _SPECIAL[mode].sub(lambda m: _char(m.group(), mode, style.rng), text) + '"'
    modes = ("raw", "ascii", "every") if style.escapes == "mixed" else (style.escapes,)
    return '"' + "".join(_char(c, style.rng.choice(modes), style.rng) for c in text) + '"'


def _char(c: str, mode: str, rng: random.Random) -> str:
    if mode == "every":
        return _unicode_escape(c, rng)
    if c in _SHORT:
        return _SHORT[c]
    if c == "/" and mode == "ascii":
        return "\\/"
    if c < " " or (mode == "ascii" and c > "~"):
        return _unicode_escape(c, rng)
    return c


def _unicode_escape(c: str, rng: random.Random) -> str:
    units = c.encode("utf-16-be", "surrogatepass")
    escape = "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2))
    return escape.upper().replace("\\U", "\\u") if rng.random() < 0.5 else escape
