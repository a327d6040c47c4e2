"""gemini-chat: ``POST …/models/{model}:generateContent`` and
``:streamGenerateContent`` (SSE with ``alt=sse``, else one JSON array).

google-genai echoes an answer as ``candidates[0].content`` (``contents.append``,
its chat history, automatic function calling). A content's normal form is the
content with these differences absorbed:

* snake_case field names: the API (proto JSON) reads ``function_call`` and
  ``functionCall`` as the same field; google-genai's ``model_dump()`` gives the
  former, the wire the latter. Free-form values (``args``, ``response``,
  ``partMetadata``) keep their keys as they are.
* null-valued keys, which ``model_dump()`` adds.
* base64 alphabets: ``thoughtSignature`` and ``inlineData.data`` are bytes;
  google-genai re-encodes them URL-safe (``-_``) where the API sent ``+/``.
  They compare as the bytes they encode.
* one model turn split over several contents and text parts: google-genai's
  chat resends a streamed answer as one content per chunk (``"Hel"``,
  ``"lo"``). Consecutive model contents are one turn, and adjacent text parts
  of it join when neither carries a signature and both are thought or both are
  not (the API documents that a signed part must not be merged).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any
from urllib.parse import urlsplit

from .common import (
    Audit,
    LiftedAnswer,
    LiftedRequest,
    Status,
    ToolResult,
    as_list,
    usage_of,
    digest_hex,
    parse_json,
    tool_result,
)

PROTOCOL = "gemini-chat"
ENDPOINT = re.compile(r"/models/([^/:]+):(generateContent|streamGenerateContent)$")
FREE_FORM_KEYS = frozenset({"args", "response", "partMetadata"})
STATUS_OF_FINISH: dict[str, Status] = {
    "STOP": "completed",
    "MAX_TOKENS": "incomplete",
    "CONTINUATION": "incomplete",  # resumed by a request that carries the continuation token
    "MALFORMED_FUNCTION_CALL": "failed",
    "UNEXPECTED_TOOL_CALL": "failed",
}
PLAIN_TEXT_KEYS = frozenset({"text", "thought"})
URL_SAFE = str.maketrans("-_", "+/")
# Hint when a call id is made up: the k-th call (or result) of a name is "name#k".
MADE_UP_IDS_HINT = {"toolCallIds": "name#k"}


def matches(path: str) -> bool:
    return ENDPOINT.search(path) is not None


def _camel(key: str) -> str:
    if "_" not in key:
        return key
    head, *rest = key.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest) if rest and head else key


def _canonical_base64(value: str) -> str:
    """Standard base64 of the bytes ``value`` encodes in either alphabet; a
    string that is not base64 stays as it is (it then equals no encoding)."""
    try:
        raw = base64.b64decode(value.translate(URL_SAFE) + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        return value
    return base64.b64encode(raw).decode("ascii")


def _structural(value: Any, key: str | None, seen: set[str]) -> Any:
    """Field names in camelCase, nulls dropped, bytes canonical, recursively,
    except inside free-form JSON values."""
    if isinstance(value, list):
        return [_structural(v, key, seen) for v in value]
    if not isinstance(value, dict):
        if isinstance(value, str) and (key == "thoughtSignature" or key == "inlineData.data"):
            seen.add("thoughtSignature" if key == "thoughtSignature" else "inlineData")
            return _canonical_base64(value)
        return value
    out = {}
    for k, v in value.items():
        if v is None:
            continue
        name = _camel(k)
        if name in FREE_FORM_KEYS:
            out[name] = v
        else:
            out[name] = _structural(v, "inlineData.data" if key == "inlineData" and name == "data" else name, seen)
    return out


def normalize_content(content: Any, seen: set[str]) -> Any:
    if not isinstance(content, dict):
        return {"$non_object": content}
    return _structural(content, None, seen)


def _is_plain_text(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str) and part.keys() <= PLAIN_TEXT_KEYS


def _join_text_runs(parts: list) -> list:
    out: list = []
    for part in parts:
        previous = out[-1] if out else None
        if _is_plain_text(part) and _is_plain_text(previous) and part.get("thought") == previous.get("thought"):
            out[-1] = {**previous, "text": previous["text"] + part["text"]}
        else:
            out.append(part)
    return out


def _is_model_turn(content: Any) -> bool:
    return (
        isinstance(content, dict)
        and content.get("role") == "model"
        and content.keys() <= {"role", "parts"}
        and isinstance(content.get("parts", []), list)
    )


def conversation(contents: list, seen: set[str]) -> list:
    """Normalized contents with each model turn as one message (see the module doc)."""
    messages: list = []
    for content in (normalize_content(c, seen) for c in contents):
        if _is_model_turn(content) and messages and _is_model_turn(messages[-1]):
            messages[-1] = {"role": "model", "parts": messages[-1].get("parts", []) + content.get("parts", [])}
            seen.add("model turn")
        else:
            messages.append(content)
    return [
        {"role": "model", "parts": _join_text_runs(m.get("parts", []))} if _is_model_turn(m) else m for m in messages
    ]


def _note_absorbed(audit: Audit, seen: set[str]) -> None:
    if "thoughtSignature" in seen:
        audit.note("thoughtSignature", "preserved", "compared as the bytes it encodes: google-genai sends it URL-safe")
    if "inlineData" in seen:
        audit.note("inlineData.data", "preserved", "compared as the bytes it encodes")
    if "model turn" in seen:
        audit.note("contents[role=model]", "preserved",
                   "consecutive model contents are one turn: google-genai resends a streamed answer by chunks")


def _name(part: dict) -> str:
    return part["name"] if isinstance(part.get("name"), str) else ""


def _call_ids(calls: list[dict]) -> tuple[list[str], bool]:
    """Each call's id, or ``name#k`` for the k-th call of that name when the
    upstream gave no id (Gemini matches results to calls by name and order).
    Second value: whether any id was made up so."""
    ids, counts, made_up = [], {}, False
    for call in calls:
        if isinstance(call.get("id"), str):
            ids.append(call["id"])
            continue
        name = _name(call)
        k = counts.get(name, 0)
        counts[name] = k + 1
        ids.append(f"{name}#{k}")
        made_up = True
    return ids, made_up


def _parts_with(messages: list, key: str) -> list[dict]:
    return [
        part[key]
        for message in messages
        if isinstance(message, dict)
        for part in as_list(message.get("parts"))
        if isinstance(part, dict) and isinstance(part.get(key), dict)
    ]


def _submitted_tool_results(messages: list) -> tuple[list[ToolResult], bool]:
    """``functionResponse`` parts after the last model turn: what this request
    answers. A response without an id answers the first call of its name in
    that turn not answered yet, as Gemini pairs them, and takes that call's id
    (google-genai's automatic function calling copies none). Second value:
    whether any id was made up (``_call_ids``)."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "model"), default=-1)
    calls = _parts_with(messages[last : last + 1], "functionCall") if last >= 0 else []
    responses = _parts_with(messages[last + 1 :], "functionResponse")
    answered = {r["id"] for r in responses if isinstance(r.get("id"), str)}
    unanswered: dict[str, list[tuple[str, bool]]] = {}  # by name: (id, made up), in call order
    for call, call_id in zip(calls, _call_ids(calls)[0]):
        if call_id not in answered:
            unanswered.setdefault(_name(call), []).append((call_id, not isinstance(call.get("id"), str)))
    results, made_up, unpaired = [], False, {}
    for response in responses:
        name = _name(response)
        if isinstance(response.get("id"), str):
            call_id = response["id"]
        elif unanswered.get(name):
            call_id, made = unanswered[name].pop(0)
            made_up = made_up or made
        else:  # no call of that name left to answer: numbered as calls without ids are
            k = unpaired[name] = unpaired.get(name, -1) + 1
            call_id, made_up = f"{name}#{k}", True
        results.append(tool_result(call_id, name or None, response.get("response")))
    return results, made_up


def lift_request(url: str, doc: Any) -> LiftedRequest | None:
    if not isinstance(doc, dict) or not isinstance(doc.get("contents"), list):
        return None
    path = urlsplit(url).path
    endpoint = ENDPOINT.search(path)
    audit = Audit(PROTOCOL, "request")
    audit.note("contents", "preserved", "the whole conversation")
    audit.note("continuation", "unsupported", "generateContent keeps no conversation state: each request resends it")
    seen: set[str] = set()
    messages = conversation(doc["contents"], seen)
    system = doc.get("systemInstruction", doc.get("system_instruction"))
    if system is not None:
        system = normalize_content(system, seen)
        audit.note("systemInstruction", "preserved", "kept apart from the contents")
    hints: dict[str, Any] = {}
    cached = doc.get("cachedContent", doc.get("cached_content"))
    if isinstance(cached, str):
        hints["cachedContent"] = cached
        audit.note("cachedContent", "unsupported", "a server-side cache holds context before these contents")
    token = doc.get("continuationToken", doc.get("continuation_token"))
    if isinstance(token, str):
        hints["continuationTokenDigest"] = digest_hex(_canonical_base64(token))
        audit.note("continuationToken", "preserved", "resumes an unfinished answer; only its digest is kept")
    results, made_up = _submitted_tool_results(messages)
    if made_up:
        hints.update(MADE_UP_IDS_HINT)
        audit.note("functionResponse.id", "lossy", "no ids: results are matched to calls by name and order")
    _note_absorbed(audit, seen)
    return LiftedRequest(
        protocol=PROTOCOL,
        model=endpoint.group(1) if endpoint else None,
        stream=bool(endpoint) and endpoint.group(2) == "streamGenerateContent",
        messages=messages,
        system=system,
        previous_response_id=None,
        submitted_tool_results=results,
        audit=audit.entries,
        hints=hints,
    )


class Answer:
    """A Gemini answer: one response object, or streamed chunks (SSE events
    or one JSON array) whose candidate 0 parts are appended in order."""

    def __init__(self) -> None:
        self._role: Any = None
        self._parts: list = []
        self._has_content = False
        self._finish_reason: Any = None
        self._response_id: Any = None
        self._continuation_token: Any = None
        self._other_candidates = False
        self._blocked = False
        self._error = False
        self._done = False
        self._usage = None

    @property
    def complete(self) -> bool:
        """A body, an error, or candidate 0's finishReason (the last chunk carries it)."""
        return self._done or self._finish_reason is not None

    def body(self, doc: Any) -> None:
        for chunk in doc if isinstance(doc, list) else [doc]:
            self._chunk(chunk)
        self._done = True

    def event(self, name: str, data: str) -> None:
        try:
            chunk = parse_json(data)
        except ValueError:
            return
        self._chunk(chunk)

    def _chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            return
        if isinstance(chunk.get("error"), dict):
            self._error = self._done = True
            return
        if self._response_id is None:
            self._response_id = chunk.get("responseId")
        self._usage = usage_of(chunk.get("usageMetadata"), "promptTokenCount", "candidatesTokenCount", self._usage)
        feedback = chunk.get("promptFeedback")
        if isinstance(feedback, dict) and feedback.get("blockReason"):
            self._blocked = True
        for candidate in as_list(chunk.get("candidates")):
            if not isinstance(candidate, dict) or candidate.get("index", 0) != 0:
                self._other_candidates = True
                continue
            content = candidate.get("content")
            if isinstance(content, dict):
                self._has_content = True
                if isinstance(content.get("role"), str):
                    self._role = content["role"]
                self._parts.extend(as_list(content.get("parts")))
            if candidate.get("finishReason"):
                self._finish_reason = candidate["finishReason"]
            if isinstance(candidate.get("continuationToken"), str):
                self._continuation_token = candidate["continuationToken"]

    def finish(self) -> LiftedAnswer | None:
        audit = Audit(PROTOCOL, "answer")
        if self._error or (self._blocked and not self._has_content):
            audit.note("error", "preserved", "the upstream refused or failed: nothing to echo")
            return LiftedAnswer(PROTOCOL, None, "failed", None, [], [], audit.entries)
        if not self._has_content and self._finish_reason is None:
            return None
        audit.note("candidates[0].content", "preserved", "the content a client appends to its history")
        audit.note("continuation", "unsupported", "generateContent keeps no conversation state")
        if self._other_candidates:
            audit.note("candidates[1:]", "dropped", "a client continues with one candidate; candidate 0 is assumed")
        seen: set[str] = set()
        messages = conversation([{"role": self._role, "parts": self._parts}], seen) if self._has_content else []
        _note_absorbed(audit, seen)
        hints: dict[str, Any] = {}
        if isinstance(self._continuation_token, str):
            hints["continuationTokenDigest"] = digest_hex(_canonical_base64(self._continuation_token))
            audit.note("continuationToken", "preserved", "resumes this unfinished answer; only its digest is kept")
        calls, made_up = _call_ids(_parts_with(messages, "functionCall"))
        if made_up:
            hints.update(MADE_UP_IDS_HINT)
            audit.note("functionCall.id", "lossy", "no ids: results are matched to calls by name and order")
        reason = self._finish_reason
        return LiftedAnswer(
            protocol=PROTOCOL,
            response_id=self._response_id if isinstance(self._response_id, str) else None,
            status=STATUS_OF_FINISH.get(reason, "incomplete") if isinstance(reason, str) else "unknown",  # never ended
            finish_reason=reason if isinstance(reason, str) else None,
            messages=messages,
            pending_tool_calls=calls,
            audit=audit.entries,
            hints=hints,
            usage=self._usage,
        )
