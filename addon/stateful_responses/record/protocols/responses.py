"""openai-responses: ``POST …/responses``.

Messages are input and output items in ``items.normalize_item``'s form, the
same form the prefix store compares: clients echo output items back as input
items (openai-python passes the objects or their ``model_dump()``), and
``items.py`` holds the equivalences those echoes need.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import msgspec

from ...items import as_item_list, normalize_item
from ...sse import RESPONSE_EVENTS, TERMINAL_EVENTS
from .common import Audit, LiftedAnswer, LiftedRequest, Status, ToolResult, parse_json, tool_result

PROTOCOL = "openai-responses"
STATUSES = frozenset({"completed", "incomplete", "failed", "in_progress", "queued", "cancelled"})
# Calls the client executes and answers with a ``*_call_output`` item; the
# server runs the others (web search, file search, code interpreter, MCP).
CLIENT_CALL_TYPES = frozenset(
    {"function_call", "custom_tool_call", "computer_call", "local_shell_call", "shell_call", "apply_patch_call"}
)
STATUS_OF_EVENT: dict[str, Status] = {
    "response.completed": "completed",
    "response.failed": "failed",
    "response.incomplete": "incomplete",
    "response.cancelled": "cancelled",
}


def matches(path: str) -> bool:
    return path.endswith("/responses")


def _is_model_item(item: Any) -> bool:
    """An item the model produced (as opposed to one the client wrote)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    if kind in (None, "message"):
        return item.get("role") == "assistant"
    return kind == "reasoning" or (isinstance(kind, str) and kind.endswith("_call"))


def _is_client_call(item: dict) -> bool:
    kind = item.get("type")
    return isinstance(kind, str) and kind in CLIENT_CALL_TYPES and isinstance(item.get("call_id"), str)


def _submitted_tool_results(items: list) -> list[ToolResult]:
    """``*_call_output`` items after the last model item: what this request answers."""
    last_model = max((i for i, item in enumerate(items) if _is_model_item(item)), default=-1)
    names = {
        item["call_id"]: item["name"]
        for item in items
        if isinstance(item, dict) and isinstance(item.get("call_id"), str) and isinstance(item.get("name"), str)
    }
    results = []
    for item in items[last_model + 1 :]:
        if (
            isinstance(item, dict)
            and isinstance(item.get("type"), str)
            and item["type"].endswith("_call_output")
            and isinstance(item.get("call_id"), str)
        ):
            results.append(tool_result(item["call_id"], names.get(item["call_id"]), normalize_item(item).get("output")))
    return results


def lift_request(url: str, doc: Any) -> LiftedRequest | None:
    if not isinstance(doc, dict):
        return None
    items = as_item_list(doc["input"]) if "input" in doc else []
    if items is None:
        return None
    return _lifted(doc, [normalize_item(i) for i in items], _submitted_tool_results(items), None)


class _Shape(msgspec.Struct):
    """What tells items apart and pairs calls with results."""

    type: Any = None
    role: Any = None
    call_id: Any = None
    name: Any = None


_SHAPE = msgspec.json.Decoder(_Shape)


def _shape_of(raw: bytes) -> dict:
    """An item read as far as ``_submitted_tool_results`` needs: a tool's
    output whole, anything else only its shape (the rest of a user message,
    which may be megabytes, is skipped unparsed)."""
    shape = _SHAPE.decode(raw)
    if isinstance(shape.type, str) and shape.type.endswith("_call_output"):
        return parse_json(raw)
    return {k: v for k, v in msgspec.structs.asdict(shape).items() if v is not None}


def lift_read(doc: dict, raw_items: list[bytes], digests: list[bytes]) -> LiftedRequest:
    """The same lift from a request the planner has already read: its small
    fields in ``doc``, its items as raw spans (strictly read objects) with
    their digests. Items are read from the newest back, and only as far as
    the results this request submits and the calls that name them, so
    recording costs next to nothing on top of planning."""
    shapes = map(_shape_of, reversed(raw_items))  # newest first, each read once
    read: list[Any] = []  # newest first: the submitted results and the model's last turn
    for item in shapes:
        if read and _is_model_item(read[-1]) and not _is_model_item(item):
            shapes = chain([item], shapes)
            break
        read.append(item)
    submitted = _submitted_tool_results(read[::-1])
    unnamed = {result.call_id for result in submitted if result.name is None}
    if unnamed:  # a call made before the model's last turn: read back to it
        for item in shapes:
            read.append(item)
            if isinstance(item.get("name"), str):
                unnamed.discard(item.get("call_id"))
            if not unnamed:
                break
        submitted = _submitted_tool_results(read[::-1])
    return _lifted(doc, [], submitted, digests)


def _lifted(doc: dict, messages: list, submitted: list[ToolResult], digests: list[bytes] | None) -> LiftedRequest:
    audit = Audit(PROTOCOL, "request")
    audit.note("input", "preserved", "items compared in items.normalize_item's form")
    instructions = doc.get("instructions")
    system: Any = None
    if isinstance(instructions, str):
        system = instructions
    elif isinstance(instructions, list):
        system = [normalize_item(i) for i in instructions]
    if system is not None:
        audit.note("instructions", "preserved", "kept apart: they apply to this request only, never stored context")
    previous = doc.get("previous_response_id")
    if isinstance(previous, str):
        audit.note("previous_response_id", "preserved", "server-side continuation: the upstream prepends its context")
    else:
        previous = None
    if doc.get("conversation") is not None:
        audit.note("conversation", "unsupported", "a stored conversation adds items this request does not show")
    model = doc.get("model")
    return LiftedRequest(
        protocol=PROTOCOL,
        model=model if isinstance(model, str) else None,
        stream=doc.get("stream") is True,
        messages=messages,
        system=system,
        previous_response_id=previous,
        submitted_tool_results=submitted,
        audit=audit.entries,
        hints={},
        digests=digests,
    )


class Answer:
    """A Responses answer: the response object of a JSON body, or of an SSE
    stream's events (``output_item.done`` items fill an empty output)."""

    def __init__(self) -> None:
        self._response: dict | None = None
        self._done_items: dict[int, Any] = {}
        self._terminal_event: str | None = None
        self._error = False

    @property
    def complete(self) -> bool:
        return self._terminal_event is not None

    def body(self, doc: Any) -> None:
        if isinstance(doc, dict):
            # An error body ({"error": {...}}), not a response whose error is null.
            self._error = isinstance(doc.get("error"), dict) and "output" not in doc
            self._response = None if self._error else doc
            self._terminal_event = "body"

    def event(self, name: str, data: str) -> None:
        if name and name not in RESPONSE_EVENTS and name not in TERMINAL_EVENTS and name != "response.output_item.done":
            return  # deltas: the done events and the final response hold the same
        try:
            doc = parse_json(data)
        except ValueError:
            return
        if not isinstance(doc, dict):
            return
        kind = doc.get("type")
        if not isinstance(kind, str):
            kind = name
        if kind in RESPONSE_EVENTS and isinstance(doc.get("response"), dict):
            self._response = doc["response"]
        elif kind == "response.output_item.done" and isinstance(doc.get("item"), dict):
            index = doc.get("output_index")
            self._done_items[index if isinstance(index, int) else len(self._done_items)] = doc["item"]
        elif kind == "error":
            self._error = True
        if kind in TERMINAL_EVENTS and self._terminal_event is None:
            self._terminal_event = kind

    def finish(self) -> LiftedAnswer | None:
        audit = Audit(PROTOCOL, "answer")
        if self._error:
            audit.note("error", "preserved", "the upstream answered with an error: nothing to echo")
            return LiftedAnswer(PROTOCOL, None, "failed", None, [], [], audit.entries)
        response = self._response
        if response is None:
            return None
        output = response.get("output")
        if not isinstance(output, list) or (not output and self._done_items):
            output = [self._done_items[i] for i in sorted(self._done_items)]
            audit.note("output", "preserved", "from response.output_item.done events: the final output was empty")
        else:
            audit.note("output", "preserved", "items compared in items.normalize_item's form")
        status = response.get("status")
        if not isinstance(status, str) or status not in STATUSES:
            status = STATUS_OF_EVENT.get(self._terminal_event or "", "unknown")
        response_id = response.get("id")
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        pending = [
            item["call_id"]
            for item in output
            if isinstance(item, dict) and _is_client_call(item)
        ]
        return LiftedAnswer(
            protocol=PROTOCOL,
            response_id=response_id if isinstance(response_id, str) else None,
            status=status,
            finish_reason=reason if isinstance(reason, str) else None,
            messages=[normalize_item(i) for i in output],
            pending_tool_calls=pending,
            audit=audit.entries,
        )
