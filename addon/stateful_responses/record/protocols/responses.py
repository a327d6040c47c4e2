"""openai-responses: ``POST …/responses``.

Messages are input and output items in ``items.normalize_item``'s form, the
same form the prefix store compares: clients echo output items back as input
items (openai-python passes the objects or their ``model_dump()``), and
``items.py`` holds the equivalences those echoes need. The ids the normal form
leaves out still tell echoes apart: a request's items are there to read
(``RequestItems``), and an answer names its items' ids (``LiftedAnswer.ids``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import msgspec

from ...items import COMPACTION_TRIGGER, as_item_list, is_compaction_trigger, normalize_item
from ...answer_reader import RESPONSE_EVENTS, TERMINAL_EVENTS
from .common import Audit, Kind, LiftedAnswer, LiftedRequest, Status, ToolResult, parse_json, tool_result, usage_of

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


def _is_output(item: dict) -> bool:
    kind = item.get("type")
    return isinstance(kind, str) and kind.endswith("_call_output") and isinstance(item.get("call_id"), str)


def _kind(item: Any) -> Kind:
    if _is_model_item(item):
        return "model"
    return "output" if isinstance(item, dict) and _is_output(item) else "other"


def _names(items: Iterable[Any]) -> dict[str, str]:
    return {item["call_id"]: item["name"] for item in items
            if isinstance(item, dict) and isinstance(item.get("call_id"), str) and isinstance(item.get("name"), str)}


class _Shape(msgspec.Struct):
    """What tells items apart, pairs calls with results and names an echo."""

    type: Any = None
    role: Any = None
    call_id: Any = None
    name: Any = None
    id: Any = None


_SHAPE = msgspec.json.Decoder(_Shape)


class RequestItems:
    """A request's items read one at a time, each at most once: raw spans
    (the planner's reading) read only as far as their shape, a tool output
    whole only for its result's size and digest; or items already parsed."""

    def __init__(self, items: Sequence[Any], raw: bool) -> None:
        self._items = items
        self._raw = raw
        self._shapes: dict[int, dict] = {}
        self._outputs: dict[int, tuple[int, str]] = {}  # a tool output's size and digest, by index

    def __len__(self) -> int:
        return len(self._items)

    def shape(self, index: int) -> dict:
        shape = self._shapes.get(index)
        if shape is None:
            item = self._items[index]
            if self._raw:
                shape = {k: v for k, v in msgspec.structs.asdict(_SHAPE.decode(item)).items() if v is not None}
            else:
                shape = item if isinstance(item, dict) else {}
            self._shapes[index] = shape
        return shape

    def kind(self, index: int) -> Kind:
        return _kind(self.shape(index))

    def ids(self, positions: Collection[int]) -> list[str | None]:
        return [i if isinstance(i := self.shape(p).get("id"), str) else None for p in positions]

    def results(self, start: int, calls: Collection[str]) -> list[ToolResult]:
        shapes = [self.shape(i) for i in range(start, len(self))]
        names = _names(shapes)
        return [self.result(start + offset, names) for offset, shape in enumerate(shapes)
                if _is_output(shape) and shape["call_id"] in calls]

    def result(self, index: int, names: dict[str, str]) -> ToolResult:
        """The tool output at ``index`` (an ``_is_output`` item), named from ``names``."""
        call_id = self.shape(index)["call_id"]
        known = self._outputs.get(index)
        if known is None:
            item = parse_json(self._items[index]) if self._raw else self._items[index]
            computed = tool_result(call_id, None, normalize_item(item).get("output"))
            known = self._outputs[index] = (computed.output_bytes, computed.digest)
        return ToolResult(call_id, names.get(call_id), *known)


def _submitted_tool_results(items: RequestItems, first: int) -> list[ToolResult]:
    """The tool outputs after the model's last turn, which starts at
    ``first``: what this request answers, as far as the request alone tells
    (the index, knowing which calls the answer before left pending, asks
    ``RequestItems.results`` instead). Calls are named from that turn on, or
    from further back when a result answers an older call."""
    end = len(items)
    last_model = max((i for i in range(first, end) if _is_model_item(items.shape(i))), default=first - 1)
    outputs = [i for i in range(last_model + 1, end) if _is_output(items.shape(i))]
    names = _names(items.shape(i) for i in range(first, end))
    unnamed = {items.shape(i)["call_id"] for i in outputs} - names.keys()
    while unnamed and first > 0:
        first -= 1
        shape = items.shape(first)
        if isinstance(shape.get("call_id"), str) and isinstance(shape.get("name"), str):
            names.setdefault(shape["call_id"], shape["name"])
            unnamed.discard(shape["call_id"])
    return [items.result(i, names) for i in outputs]


def lift_request(url: str, doc: Any) -> LiftedRequest | None:
    if not isinstance(doc, dict):
        return None
    listed = as_item_list(doc["input"]) if "input" in doc else []
    if listed is None:
        return None
    content = [i for i in listed if not (isinstance(i, dict) and i.get("type") == COMPACTION_TRIGGER)]
    items = RequestItems(content, raw=False)
    lifted = _lifted(doc, [normalize_item(i) for i in content], _submitted_tool_results(items, 0), None, items)
    return _noted_trigger(lifted, len(content) < len(listed))


def _noted_trigger(lifted: LiftedRequest, triggered: bool) -> LiftedRequest:
    """A compaction trigger is a control signal, not content: left out of the
    conversation (never recorded, never part of a chain's keys), and said so."""
    if triggered:
        audit = Audit(PROTOCOL, "request")
        audit.note("compaction_trigger", "dropped", "a control signal asking for a compaction, not content")
        lifted.audit.extend(audit.entries)
        lifted.hints["compaction"] = "trigger"
    return lifted


def lift_read(doc: dict, raw_items: list[bytes], digests: list[bytes]) -> LiftedRequest:
    """The same lift from a request the planner has already read: its small
    fields in ``doc``, its items as raw spans (strictly read objects) with
    their digests. Items are read from the newest back, and only as far as
    the results this request submits and the calls that name them, so
    recording costs next to nothing on top of planning."""
    kept = [i for i, raw in enumerate(raw_items) if not is_compaction_trigger(raw)]
    triggered = len(kept) < len(raw_items)
    if triggered:
        raw_items, digests = [raw_items[i] for i in kept], [digests[i] for i in kept]
    items = RequestItems(raw_items, raw=True)
    first = len(items)  # back to the start of the model's last turn
    while first > 0 and not (first < len(items) and _is_model_item(items.shape(first))
                             and not _is_model_item(items.shape(first - 1))):
        first -= 1
    return _noted_trigger(_lifted(doc, [], _submitted_tool_results(items, first), digests, items), triggered)


def _lifted(doc: dict, messages: list, submitted: list[ToolResult], digests: list[bytes] | None,
            items: RequestItems) -> LiftedRequest:
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
    conversation = doc.get("conversation")
    conversation_id = conversation.get("id") if isinstance(conversation, dict) else conversation
    if isinstance(conversation_id, str):
        audit.note("conversation", "preserved", "a stored conversation: its items come before this request's, "
                   "and the turn continues the conversation's chain")
    else:
        conversation_id = None
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
        items=items,
        conversation_id=conversation_id,
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
            ids=[i["id"] if isinstance(i, dict) and isinstance(i.get("id"), str) else None for i in output],
            usage=usage_of(response.get("usage"), "input_tokens", "output_tokens"),
        )
