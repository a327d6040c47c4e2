"""openai-chat: ``POST …/chat/completions``.

A message's normal form is the message itself with these differences absorbed,
each seen in what real clients send back (captured against a loopback stub):

* null-valued keys: openai-python echoes ``"refusal": null``, ``model_dump()``
  adds ``"audio": null``, ``"function_call": null``; the API reads null as absent.
* ``annotations``: URL citations about the text. The SDK echoes ``[]`` from a
  JSON answer and null from a streamed one; the text they annotate is compared.
* ``parsed`` and ``tool_calls[].function.parsed_arguments``: the SDK's own
  parse of ``content`` and ``arguments`` (its stream helper echoes them);
  derived from what is compared.
* ``tool_calls[].index``: the stream position the SDK's accumulator keeps;
  the list order says the same.
* string ``content`` is one text part, as the API defines it; an assistant's
  empty string is no content (langchain echoes a tool-call-only turn's ``""``
  as null).
* ``arguments`` compare as parsed JSON (langchain re-serializes them).

System and developer messages stay in ``messages``: Chat has no separate
system field, and the model reads them where they stand.
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
    comparable_arguments,
    parse_json,
    tool_result,
    without_nulls,
)

PROTOCOL = "openai-chat"
STATUS_OF_FINISH: dict[str, Status] = {
    "stop": "completed",
    "tool_calls": "completed",
    "function_call": "completed",
    "length": "incomplete",
    "content_filter": "incomplete",
}
ABSORBED = {
    "annotations": ("messages[].annotations", "citations of the text: the SDK echoes [] or null; the text is compared"),
    "parsed": ("messages[].parsed", "the openai SDK's own parse of content: derived from the content compared"),
    "index": ("messages[].tool_calls[].index", "the SDK's stream position: the list order says the same"),
    "parsed_arguments": (
        "messages[].tool_calls[].function.parsed_arguments",
        "the openai SDK's own parse of arguments: derived from the arguments compared",
    ),
}


def matches(path: str) -> bool:
    return path.endswith("/chat/completions")


def _pop_absorbed(value: dict, key: str, seen: set[str]) -> None:
    if key in value:
        del value[key]
        seen.add(key)


def _tool_call(call: Any, seen: set[str]) -> Any:
    if not isinstance(call, dict):
        return call
    out = without_nulls(call)
    _pop_absorbed(out, "index", seen)
    function = out.get("function")
    if isinstance(function, dict):
        function = without_nulls(function)
        _pop_absorbed(function, "parsed_arguments", seen)
        if "arguments" in function:
            function["arguments"] = comparable_arguments(function["arguments"])
        out["function"] = function
    return out


def normalize_message(message: Any, seen: set[str]) -> Any:
    """The comparison form of one message; ``seen`` collects the absorbed keys met."""
    if not isinstance(message, dict):
        return {"$non_object": message}
    out = without_nulls(message)
    _pop_absorbed(out, "annotations", seen)
    _pop_absorbed(out, "parsed", seen)
    content = out.get("content")
    if content == "" and out.get("role") == "assistant":
        del out["content"]
    elif isinstance(content, str):
        out["content"] = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        out["content"] = [without_nulls(part) if isinstance(part, dict) else part for part in content]
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_tool_call(call, seen) for call in out["tool_calls"]]
    if isinstance(out.get("function_call"), dict):
        out["function_call"] = _tool_call({"function": out["function_call"]}, seen)["function"]
    return out


def _note_absorbed(audit: Audit, seen: set[str]) -> None:
    for key in sorted(seen):
        field_name, reason = ABSORBED[key]
        audit.note(field_name, "dropped", reason)


def _submitted_tool_results(messages: list, normalized: list) -> list[ToolResult]:
    """``tool`` messages after the last assistant message: what this request answers."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"), default=-1)
    names: dict[str, str] = {}
    if last >= 0:
        for call in as_list(messages[last].get("tool_calls")):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(call.get("id"), str) and isinstance(function.get("name"), str):
                names[call["id"]] = function["name"]
    return [
        tool_result(raw["tool_call_id"], names.get(raw["tool_call_id"]), norm.get("content"))
        for raw, norm in zip(messages[last + 1 :], normalized[last + 1 :])
        if isinstance(raw, dict) and raw.get("role") == "tool" and isinstance(raw.get("tool_call_id"), str)
    ]


def lift_request(url: str, doc: Any) -> LiftedRequest | None:
    if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list):
        return None
    audit = Audit(PROTOCOL, "request")
    audit.note("messages", "preserved", "the whole conversation, system and developer messages in place")
    audit.note("continuation", "unsupported", "Chat Completions keeps no conversation state: each request resends it")
    seen: set[str] = set()
    messages = [normalize_message(m, seen) for m in doc["messages"]]
    _note_absorbed(audit, seen)
    model = doc.get("model")
    return LiftedRequest(
        protocol=PROTOCOL,
        model=model if isinstance(model, str) else None,
        stream=doc.get("stream") is True,
        messages=messages,
        system=None,
        previous_response_id=None,
        submitted_tool_results=_submitted_tool_results(doc["messages"], messages),
        audit=audit.entries,
        hints={},
    )


def accumulate_delta(acc: dict, delta: dict) -> dict:
    """openai-python's ``lib/streaming/_deltas.accumulate_delta``, the way its
    stream helper builds the message a client echoes: strings concatenate,
    ``index``/``type`` are replaced, list entries merge by their ``index``.
    Raises TypeError where the SDK raises (the client then gets no message)."""
    for key, delta_value in delta.items():
        if key not in acc or acc[key] is None:
            if _has_indexed_entries(delta_value):
                acc[key] = []
            else:
                acc[key] = delta_value
                continue
        acc_value = acc[key]
        if key in ("index", "type"):
            acc[key] = delta_value
            continue
        if isinstance(acc_value, str) and isinstance(delta_value, str):
            acc_value += delta_value
        elif isinstance(acc_value, (int, float)) and isinstance(delta_value, (int, float)):
            acc_value += delta_value
        elif isinstance(acc_value, dict) and isinstance(delta_value, dict):
            acc_value = accumulate_delta(acc_value, delta_value)
        elif isinstance(acc_value, list) and isinstance(delta_value, list):
            if all(isinstance(x, (str, int, float)) for x in acc_value) and (
                acc_value or not _has_indexed_entries(delta_value)
            ):
                acc_value.extend(delta_value)
                continue
            for entry in delta_value:
                index = entry.get("index") if isinstance(entry, dict) else None
                if not isinstance(index, int):
                    raise TypeError("a list delta entry without an integer index")
                try:  # a negative index counts from the end, as in openai-python
                    acc_entry = acc_value[index]
                except IndexError:
                    acc_value.insert(index, entry)
                else:
                    if not isinstance(acc_entry, dict):
                        raise TypeError("a list delta entry merged into a non-object")
                    acc_value[index] = accumulate_delta(acc_entry, entry)
        acc[key] = acc_value
    return acc


def _has_indexed_entries(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(e, dict) and "index" in e for e in value)


def _status(finish_reason: Any) -> Status:
    """An answer without a finish reason never ended (a stream that stopped early): ``unknown``."""
    return STATUS_OF_FINISH.get(finish_reason, "incomplete") if isinstance(finish_reason, str) else "unknown"


class Answer:
    """A Chat answer: ``choices[0].message`` of a JSON body, or choice 0's
    deltas accumulated as openai-python's stream helper does."""

    def __init__(self) -> None:
        self._message: dict | None = None
        self._finish_reason: Any = None
        self._response_id: Any = None
        self._other_choices = False
        self._done = False
        self._error = False
        self._usage = None

    @property
    def complete(self) -> bool:
        """``[DONE]``, an error, or choice 0's finish_reason: its message is final then."""
        return self._done or self._finish_reason is not None

    def body(self, doc: Any) -> None:
        if not isinstance(doc, dict):
            return
        self._done = True
        choices = doc.get("choices")
        if not isinstance(choices, list):
            self._error = isinstance(doc.get("error"), dict)
            return
        self._response_id = doc.get("id")
        self._usage = usage_of(doc.get("usage"), "prompt_tokens", "completion_tokens")
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                if isinstance(choice.get("message"), dict):
                    self._message = choice["message"]
                self._finish_reason = choice.get("finish_reason")
            else:
                self._other_choices = True

    def event(self, name: str, data: str) -> None:
        if data.startswith("[DONE]"):
            self._done = True
            return
        try:
            chunk = parse_json(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        if chunk.get("error"):
            self._error = self._done = True
            return
        if chunk.get("object", "chat.completion.chunk") != "chat.completion.chunk":
            return  # the SDK's stream helper skips these (Azure's content filter events)
        if self._response_id is None:
            self._response_id = chunk.get("id")
        self._usage = usage_of(chunk.get("usage"), "prompt_tokens", "completion_tokens", self._usage)
        for choice in as_list(chunk.get("choices")):
            if not isinstance(choice, dict) or choice.get("index") != 0:
                self._other_choices = True
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._message = accumulate_delta(self._message if self._message is not None else {}, delta)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]

    def finish(self) -> LiftedAnswer | None:
        audit = Audit(PROTOCOL, "answer")
        if self._error:
            audit.note("error", "preserved", "the upstream answered with an error: nothing to echo")
            return LiftedAnswer(PROTOCOL, None, "failed", None, [], [], audit.entries)
        if self._message is None:
            return None
        audit.note("choices[0].message", "preserved", "the message a client appends to its history")
        audit.note("continuation", "unsupported", "Chat Completions keeps no conversation state")
        if self._other_choices:
            audit.note("choices[1:]", "dropped", "a client continues with one choice; choice 0 is assumed")
        seen: set[str] = set()
        message = normalize_message(self._message, seen)
        _note_absorbed(audit, seen)
        pending = [
            call["id"]
            for call in as_list(self._message.get("tool_calls"))
            if isinstance(call, dict) and isinstance(call.get("id"), str)
        ]
        return LiftedAnswer(
            protocol=PROTOCOL,
            response_id=self._response_id if isinstance(self._response_id, str) else None,
            status=_status(self._finish_reason),
            finish_reason=self._finish_reason if isinstance(self._finish_reason, str) else None,
            messages=[message],
            pending_tool_calls=pending,
            audit=audit.entries,
            usage=self._usage,
        )
