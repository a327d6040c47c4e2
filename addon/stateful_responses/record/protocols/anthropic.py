"""anthropic-messages: ``POST …/v1/messages``.

A client echoes an answer as ``{"role": "assistant", "content": resp.content}``
(the anthropic SDK's own docs and tool runner). A message's normal form is the
message with these differences absorbed:

* null-valued keys: the SDK echoes ``"citations": null`` as the answer had it,
  and ``model_dump()`` adds ``"caller": null``, ``"toolset_name": null``.
* string ``content`` (and a ``tool_result``'s string ``content``) is one text
  block, as the API defines it.
* ``cache_control``: a prompt-caching breakpoint, not content; clients such as
  Claude Code move it to the newest message on every turn.

``tool_use.input`` is a JSON object on the wire and compares as one (key order
never matters). Thinking text, its ``signature`` and ``redacted_thinking``
data are compared exactly: the API verifies them.
"""

from __future__ import annotations

from typing import Any

from .common import (
    Audit,
    LiftedAnswer,
    LiftedRequest,
    Status,
    ToolResult,
    as_list,
    usage_of,
    parse_json,
    tool_result,
    without_nulls,
)

PROTOCOL = "anthropic-messages"
STATUS_OF_STOP: dict[str, Status] = {
    "end_turn": "completed",
    "stop_sequence": "completed",
    "tool_use": "completed",
    "pause_turn": "incomplete",  # a server tool loop paused: the client resends to let it go on
    "max_tokens": "incomplete",
    "model_context_window_exceeded": "incomplete",
    "refusal": "failed",  # the API asks clients not to continue from a refused turn: a dead end
}
# Blocks whose input streams as input_json_delta (the SDK's TRACKS_TOOL_INPUT).
INPUT_BLOCKS = frozenset({"tool_use", "server_tool_use"})


def matches(path: str) -> bool:
    return path.endswith("/v1/messages")


def _block(block: Any, seen: set[str]) -> Any:
    if not isinstance(block, dict):
        return {"$non_object": block}
    out = without_nulls(block)
    if "cache_control" in out:
        del out["cache_control"]
        seen.add("cache_control")
    if out.get("type") == "tool_result" and "content" in out:
        out["content"] = _content(out["content"], seen)
    return out


def _content(content: Any, seen: set[str]) -> Any:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [_block(b, seen) for b in content]
    return content


def normalize_message(message: Any, seen: set[str]) -> Any:
    """The comparison form of one message; ``seen`` collects the absorbed keys met."""
    if not isinstance(message, dict):
        return {"$non_object": message}
    out = without_nulls(message)
    if "content" in out:
        out["content"] = _content(out["content"], seen)
    return out


def _note_absorbed(audit: Audit, seen: set[str]) -> None:
    if "cache_control" in seen:
        audit.note("cache_control", "dropped", "a prompt-caching breakpoint, not content: clients move it every turn")


def _submitted_tool_results(messages: list, normalized: list) -> list[ToolResult]:
    """``tool_result`` blocks after the last assistant message: what this request answers."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"), default=-1)
    names = {
        block["id"]: block["name"]
        for block in (as_list(messages[last].get("content")) if last >= 0 else [])
        if isinstance(block, dict) and isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
    }
    return [
        tool_result(block["tool_use_id"], names.get(block["tool_use_id"]), block.get("content"))
        for message in normalized[last + 1 :]
        for block in as_list(message.get("content"))
        if isinstance(block, dict) and block.get("type") == "tool_result" and isinstance(block.get("tool_use_id"), str)
    ]


def lift_request(url: str, doc: Any) -> LiftedRequest | None:
    if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list):
        return None
    audit = Audit(PROTOCOL, "request")
    audit.note("messages", "preserved", "the whole conversation")
    audit.note("continuation", "unsupported", "the Messages API keeps no conversation state: each request resends it")
    seen: set[str] = set()
    messages = [normalize_message(m, seen) for m in doc["messages"]]
    system = doc.get("system")
    if system is not None:
        system = _content(system, seen)
        audit.note("system", "preserved", "kept apart from the messages")
    _note_absorbed(audit, seen)
    model = doc.get("model")
    return LiftedRequest(
        protocol=PROTOCOL,
        model=model if isinstance(model, str) else None,
        stream=doc.get("stream") is True,
        messages=messages,
        system=system,
        previous_response_id=None,
        submitted_tool_results=_submitted_tool_results(doc["messages"], messages),
        audit=audit.entries,
        hints={},
    )


class Answer:
    """An Anthropic answer: a JSON message, or SSE events accumulated as the
    SDK's ``accumulate_event`` does (text, thinking and tool input appended,
    a signature replaced, tool input parsed from its JSON fragments)."""

    def __init__(self) -> None:
        self._message: dict | None = None
        self._blocks: list[Any] = []
        self._input_json: dict[int, str] = {}
        self._stop_reason: Any = None
        self._done = False
        self._error = False
        self._usage = None

    @property
    def complete(self) -> bool:
        return self._done

    def body(self, doc: Any) -> None:
        if not isinstance(doc, dict):
            return
        self._done = True
        if doc.get("type") == "error" or "content" not in doc:
            self._error = isinstance(doc.get("error"), dict)
            return
        self._message = doc
        self._blocks = as_list(doc.get("content"))
        self._input_json = {}
        self._stop_reason = doc.get("stop_reason")
        self._usage = usage_of(doc.get("usage"), "input_tokens", "output_tokens")

    def event(self, name: str, data: str) -> None:
        try:
            doc = parse_json(data)
        except ValueError:
            return
        if not isinstance(doc, dict):
            return
        kind = doc.get("type", name)
        if kind == "error":
            self._error = self._done = True
        elif kind == "message_start":
            if isinstance(doc.get("message"), dict):
                self._message = doc["message"]
                self._usage = usage_of(self._message.get("usage"), "input_tokens", "output_tokens", self._usage)
                self._blocks = [dict(b) if isinstance(b, dict) else b for b in as_list(self._message.get("content"))]
        elif self._message is None:
            return  # the SDK refuses events before message_start
        elif kind == "content_block_start" and isinstance(doc.get("content_block"), dict):
            self._blocks.append(dict(doc["content_block"]))
        elif kind == "content_block_delta":
            self._delta(doc.get("index"), doc.get("delta"))
        elif kind == "message_delta" and isinstance(doc.get("delta"), dict):
            self._stop_reason = doc["delta"].get("stop_reason")
            self._usage = usage_of(doc.get("usage"), "input_tokens", "output_tokens", self._usage)  # cumulative
        elif kind == "message_stop":
            self._done = True

    def _delta(self, index: Any, delta: Any) -> None:
        if not isinstance(index, int) or not 0 <= index < len(self._blocks) or not isinstance(delta, dict):
            return
        block = self._blocks[index]
        if not isinstance(block, dict):
            return
        kind, part = block.get("type"), delta.get("type")
        if not isinstance(kind, str):
            return
        if part == "text_delta" and kind == "text":
            block["text"] = _text(block.get("text")) + _text(delta.get("text"))
        elif part == "thinking_delta" and kind == "thinking":
            block["thinking"] = _text(block.get("thinking")) + _text(delta.get("thinking"))
        elif part == "signature_delta" and kind == "thinking":
            block["signature"] = delta.get("signature")
        elif part == "input_json_delta" and kind in INPUT_BLOCKS:
            self._input_json[index] = self._input_json.get(index, "") + _text(delta.get("partial_json"))
        elif part == "citations_delta" and kind == "text":
            block["citations"] = [*as_list(block.get("citations")), delta.get("citation")]

    def finish(self) -> LiftedAnswer | None:
        audit = Audit(PROTOCOL, "answer")
        if self._error:
            audit.note("error", "preserved", "the upstream answered with an error: nothing to echo")
            return LiftedAnswer(PROTOCOL, None, "failed", None, [], [], audit.entries)
        if self._message is None:
            return None
        for index, fragments in self._input_json.items():
            if fragments and isinstance(self._blocks[index], dict):
                try:
                    self._blocks[index]["input"] = parse_json(fragments)
                except ValueError:
                    # Cut off (max_tokens): the SDK keeps a partial parse this
                    # lifter cannot reproduce, so it must never compare equal.
                    self._blocks[index]["input"] = {"$unparsed_json": fragments}
                    audit.note("content[].input", "lossy", "streamed tool input is not complete JSON")
        audit.note("content", "preserved", "echoed as {role: assistant, content}")
        audit.note("continuation", "unsupported", "the Messages API keeps no conversation state")
        seen: set[str] = set()
        message = normalize_message({"role": "assistant", "content": self._blocks}, seen)
        _note_absorbed(audit, seen)
        pending = [
            b["id"]
            for b in self._blocks
            if isinstance(b, dict) and b.get("type") == "tool_use" and isinstance(b.get("id"), str)
        ]
        response_id = self._message.get("id")
        stop = self._stop_reason
        return LiftedAnswer(
            protocol=PROTOCOL,
            response_id=response_id if isinstance(response_id, str) else None,
            status=STATUS_OF_STOP.get(stop, "incomplete") if isinstance(stop, str) else "unknown",  # never ended
            finish_reason=stop if isinstance(stop, str) else None,
            messages=[message],
            pending_tool_calls=pending,
            audit=audit.entries,
            paused=stop == "pause_turn",
            usage=self._usage,
        )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
