"""What every lifter shares: the lifted shapes, the audit, and small helpers.

A lifter turns one protocol's request into the conversation as the model sees
it, and its answer into what a client echoes back next turn, both in one
*comparison normal form* per protocol. The normal form exists only to compare
and hash; nothing normalized is ever sent anywhere. It absorbs differences
that do not change what the model sees (each module says which and why) and
nothing else.

Privacy: the lifted messages hold prompt content and stay in memory. Audit
entries, hints and ``ToolResult`` carry field names, ids, sizes and digests
only; a ``ToolResult`` digest is unkeyed, so the record keys it with the
store's secret before it reaches the record file.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from blake3 import blake3

from ...items import canonical_json

Protocol = Literal["openai-responses", "openai-chat", "anthropic-messages", "gemini-chat"]
Disposition = Literal["preserved", "lossy", "dropped", "unsupported"]
# Statuses follow the Responses API's, the one protocol that has them.
Status = Literal["completed", "incomplete", "failed", "in_progress", "queued", "cancelled", "unknown"]

DIGEST_SIZE = 16


@dataclass(frozen=True)
class AuditEntry:
    """One line of ``protocolMapping``: what happened to one field in a lift.

    ``targetProtocol`` is None: a lift maps a protocol onto the unified chat
    semantics, not onto another protocol."""

    field: str
    disposition: Disposition
    reason: str
    sourceProtocol: str
    targetProtocol: str | None
    source: str  # "request" or "answer"


@dataclass(frozen=True)
class ToolResult:
    """A tool result a request submits, without its content."""

    call_id: str
    name: str | None
    output_bytes: int  # size of the result's normal form as canonical JSON
    digest: str  # blake3 of that, hex, unkeyed: never written as it is


# What an item of a request is, as far as following echoes needs: the model's
# (an echoed answer item), a tool's output the client wrote, or anything else.
Kind = Literal["model", "output", "other"]


class Items(typing.Protocol):
    """A request's messages read one by one on demand, beyond their digests:
    what the index needs to follow an echo the prefix alone does not show
    (tool outputs interleaved with their calls, echoed item ids), read only
    as far back as it asks, so that long histories cost no more."""

    def kind(self, index: int) -> Kind: ...

    def ids(self, positions: Collection[int]) -> list[str | None]:
        """The ids the client sent on these messages (None: none)."""
        ...

    def results(self, start: int, calls: Collection[str]) -> list[ToolResult]:
        """The tool results from ``start`` on that answer one of ``calls``, in order."""
        ...


@dataclass
class LiftedRequest:
    protocol: Protocol
    model: str | None
    stream: bool
    messages: list[Any]  # the conversation, oldest first, in the comparison normal form
    system: Any | None  # instructions / system / systemInstruction, kept apart
    previous_response_id: str | None  # openai-responses only
    submitted_tool_results: list[ToolResult]
    audit: list[AuditEntry]
    hints: dict[str, Any]
    # The messages' digests, when the caller already has them (the planner's,
    # for Responses items: the same normal form): nothing is hashed twice.
    digests: list[bytes] | None = None
    # The messages one by one (Responses, whose items carry ids and whose tool
    # outputs may sit between the calls they answer); None for the others.
    items: Items | None = None
    conversation_id: str | None = None  # openai-responses: the stored conversation it is made in


@dataclass(frozen=True)
class Usage:
    """The tokens an answer says it used (None: it does not say): counts, never content."""

    input_tokens: int | None = None
    output_tokens: int | None = None


def usage_of(doc: Any, input_key: str, output_key: str, before: Usage | None = None) -> Usage | None:
    """The usage ``doc`` (a usage object) reports, over what ``before`` had:
    a field it lacks keeps the earlier count (streams report it in parts)."""
    if not isinstance(doc, dict):
        return before
    before = before or Usage()
    return Usage(_count(doc.get(input_key), before.input_tokens), _count(doc.get(output_key), before.output_tokens))


def _count(value: Any, otherwise: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else otherwise


@dataclass
class LiftedAnswer:
    protocol: Protocol
    response_id: str | None
    status: Status
    finish_reason: str | None  # the protocol's own stop/finish reason, as sent
    messages: list[Any]  # what a client echoes back, same normal form as LiftedRequest.messages
    pending_tool_calls: list[str]
    audit: list[AuditEntry]
    hints: dict[str, Any] = field(default_factory=dict)
    ids: list[str | None] = field(default_factory=list)  # each message's own id, where it has one (Responses)
    # A server tool loop paused (Anthropic's pause_turn): the client resends the
    # conversation as it stands, this answer included, to let it go on.
    paused: bool = False
    usage: Usage | None = None  # the tokens it reports, where it does


class Audit:
    """Collects audit entries for one lift; the first note of a field wins."""

    def __init__(self, protocol: Protocol, source: str) -> None:
        self.protocol = protocol
        self.source = source
        self._entries: dict[tuple[str, str], AuditEntry] = {}

    def note(self, field_name: str, disposition: Disposition, reason: str) -> None:
        key = (field_name, disposition)
        if key not in self._entries:
            self._entries[key] = AuditEntry(field_name, disposition, reason, self.protocol, None, self.source)

    @property
    def entries(self) -> list[AuditEntry]:
        return list(self._entries.values())


def parse_json(data: bytes | bytearray | str) -> Any:
    """The JSON value of ``data``; ValueError (never anything else) if it is not JSON."""
    try:
        return json.loads(data)
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError("not JSON") from e


def digest_hex(value: Any) -> str:
    return blake3(canonical_json(value)).hexdigest(DIGEST_SIZE)


def tool_result(call_id: str, name: str | None, normalized_output: Any) -> ToolResult:
    encoded = canonical_json(normalized_output)
    return ToolResult(call_id, name, len(encoded), blake3(encoded).hexdigest(DIGEST_SIZE))


def without_nulls(value: dict) -> dict:
    """A shallow copy without null-valued keys: every protocol here treats a
    null field as an absent one, and SDK dumps add nulls for unset fields."""
    return {k: v for k, v in value.items() if v is not None}


def comparable_arguments(arguments: Any) -> Any:
    """Tool-call arguments sent as a JSON string compare as parsed JSON:
    clients re-serialize them (whitespace, key order) without changing a value.
    An invalid JSON string stays a string, so it never equals a parsed one."""
    if isinstance(arguments, str):
        try:
            return {"$json": json.loads(arguments)}
        except (ValueError, RecursionError):
            return arguments
    return arguments


def as_list(value: Any) -> list:
    """``value`` if it is a list, else no entries: a field of the wrong type
    in a body is read as absent, never as a reason to fail."""
    return value if isinstance(value, list) else []
