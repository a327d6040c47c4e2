"""The events the API streams for one response, and their wire form.

The stream ends after its terminal event; like OpenAI's API (and unlike the
Open Responses specification), no ``data: [DONE]`` follows.
"""

from __future__ import annotations

import json
import re
import secrets
import string

OBFUSCATION_ALPHABET = string.ascii_letters + string.digits
TERMINAL_EVENT = {"completed": "response.completed", "failed": "response.failed", "incomplete": "response.incomplete"}


def encode_event(event: dict) -> bytes:
    """``event:`` names the type, ``data:`` carries the event (the spec and the API agree)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def wants_obfuscation(body: dict) -> bool:
    """Whether a request's stream pads its deltas (``stream_options.include_obfuscation``, default true)."""
    stream_options = body.get("stream_options")
    return not (isinstance(stream_options, dict) and stream_options.get("include_obfuscation") is False)


def obfuscation_padding(delta: str) -> str:
    """Random padding on delta events, which the API sends by default so that
    event sizes do not give away the tokens' lengths."""
    return "".join(secrets.choice(OBFUSCATION_ALPHABET) for _ in range(max(2, 16 - len(delta))))


def _shell(response: dict, status: str) -> dict:
    """The response as it stands before any output: what ``response.created``,
    ``response.queued`` and ``response.in_progress`` carry."""
    return {**response, "status": status, "output": [], "usage": None, "completed_at": None,
            "error": None, "incomplete_details": None}


def sse_events(response: dict, terminal_event: str | None = None, *, queued: bool = False,
               obfuscation: bool = True) -> list[dict]:
    """The event sequence the API streams for one finished response.

    ``queued`` starts as a background response does (created and queued while
    waiting, then in progress). ``obfuscation`` follows the request's
    ``stream_options.include_obfuscation``. ``terminal_event`` overrides the
    last event's name, as servers do that end every stream with
    ``response.completed`` whatever the status (vLLM).
    """
    events = _opening(response, queued, running=True)

    def delta(event: dict) -> dict:
        if obfuscation:
            event["obfuscation"] = obfuscation_padding(event["delta"])
        return event

    for index, item in enumerate(response["output"]):
        events.append({"type": "response.output_item.added", "output_index": index, "item": _added(item)})
        where = {"item_id": item.get("id"), "output_index": index}
        if item["type"] == "message":
            for part_index, part in enumerate(item["content"]):
                at = {**where, "content_index": part_index}
                events.append({"type": "response.content_part.added", **at, "part": {**part, "text": ""}})
                for word in re.findall(r"\S+\s*", part["text"]):
                    events.append(delta({"type": "response.output_text.delta", **at, "delta": word, "logprobs": []}))
                events.append({"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []})
                events.append({"type": "response.content_part.done", **at, "part": part})
        elif item["type"] == "function_call":
            events.append(delta({"type": "response.function_call_arguments.delta", **where,
                                 "delta": item["arguments"]}))
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        elif item["type"] == "reasoning":
            for summary_index, part in enumerate(item.get("summary") or []):
                at = {**where, "summary_index": summary_index}
                events.append({"type": "response.reasoning_summary_part.added", **at, "part": {**part, "text": ""}})
                events.append(delta({"type": "response.reasoning_summary_text.delta", **at, "delta": part["text"]}))
                events.append({"type": "response.reasoning_summary_text.done", **at, "text": part["text"]})
                events.append({"type": "response.reasoning_summary_part.done", **at, "part": part})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": terminal_event or TERMINAL_EVENT[response["status"]], "response": response})
    return _numbered(events)


def _opening(response: dict, queued: bool, running: bool) -> list[dict]:
    """The state events before any output: created (and queued, for a
    background response), then in progress once it runs."""
    events = [{"type": "response.created", "response": _shell(response, "queued" if queued else "in_progress")}]
    if queued:
        events.append({"type": "response.queued", "response": _shell(response, "queued")})
    if running:
        events.append({"type": "response.in_progress", "response": _shell(response, "in_progress")})
    return events


def background_events(response: dict, *, obfuscation: bool = True) -> list[dict]:
    """The events a streamed background response has sent by the time it is in
    ``response``'s state; a stream sends each new one as the state advances.
    (A cancelled response's stream just ends: the API names no event for it.)"""
    if response["status"] in TERMINAL_EVENT:
        return sse_events(response, queued=True, obfuscation=obfuscation)
    return _numbered(_opening(response, queued=True, running=response["status"] != "queued"))


def _added(item: dict) -> dict:
    """An item as ``response.output_item.added`` first shows it: in progress,
    with nothing generated yet. A reasoning item's ``encrypted_content`` is
    still incomplete there (clients take items from ``.done``)."""
    added = dict(item)
    if "status" in item:
        added["status"] = "in_progress"
    if item["type"] == "message":
        added["content"] = []
    elif item["type"] == "function_call":
        added["arguments"] = ""
    elif item["type"] == "reasoning":
        added["summary"] = []
        if "encrypted_content" in item:
            added["encrypted_content"] = item["encrypted_content"][:4]
    return added


def error_events(response: dict, error: dict) -> list[dict]:
    """A stream that fails after it started: created, in progress, then an
    ``error`` event. OpenAI's API nests the error under ``error`` on the wire
    (its reference documents the fields flat; the spec nests them too)."""
    return _numbered(_opening(response, queued=False, running=True) + [{"type": "error", "error": error}])


def _numbered(events: list[dict]) -> list[dict]:
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return events
