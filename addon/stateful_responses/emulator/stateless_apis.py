"""What the stateless conversation APIs served besides Responses share (chat.py,
anthropic.py, gemini.py): a request read as a conversation, the deterministic
model's turn over it, and the interface each protocol module implements.

The model follows the Responses model's rule: it calls a function tool when the
newest message is the user's and says ``call:NAME({json})`` and NAME is an
offered function; otherwise it answers with a digest of exactly the context it
saw. These APIs keep no state, so every request is answered from its own body.
Nothing here knows HTTP.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import APIError

CALL_PATTERN = re.compile(r"call:([A-Za-z_][A-Za-z0-9_]*)\((\{.*?\})\)")
BYTES_PER_TOKEN = 4  # the emulator's token counts: about 4 bytes a token
ARGUMENT_FRAGMENT_CHARS = 8  # streamed tool arguments come in fragments of this size
ID_ALPHABET = string.ascii_letters + string.digits


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def context_digest(items: Any) -> str:
    return hashlib.sha256(canonical(items)).hexdigest()[:16]


def random_id(length: int) -> str:
    """Letters and digits, as the APIs' own ids (``chatcmpl-…``, ``msg_01…``) are."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(length))


def words(text: str) -> list[str]:
    """Text as streamed: a word (with its trailing space) at a time."""
    return re.findall(r"\S+\s*", text) or [text]


def fragments(text: str) -> list[str]:
    """Tool-call arguments as streamed: short fragments, cut anywhere."""
    return [text[i:i + ARGUMENT_FRAGMENT_CHARS] for i in range(0, len(text), ARGUMENT_FRAGMENT_CHARS)] or [""]


def positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def joined_text(content: Any) -> str:
    """The text of a message's content: a string, or the text of its ``text``
    parts (Chat's and Anthropic's content shapes agree on this)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content
                        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


@dataclass(frozen=True)
class Call:
    """One request as a protocol module reads it: the parsed body (None when it
    is not JSON), lower-cased headers, what the route captured from the path,
    the query, and the raw body's size and hash (for the log)."""

    body: Any
    headers: Mapping[str, str]
    path: Mapping[str, str]
    query: Mapping[str, str]
    body_bytes: int
    body_sha256: str


@dataclass(frozen=True)
class Conversation:
    """A valid request, read. ``context`` is the conversation the model sees,
    as received; ``system`` the system prompt as received (None without one);
    ``user_text`` the newest message's text when that message is the user's."""

    model: str
    stream: bool
    context: list
    system: Any
    functions: frozenset[str]
    user_text: str | None
    max_tokens: int | None
    body: dict
    query: Mapping[str, str]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Turn:
    """The model's answer before a protocol shapes it: a text or a tool call.
    ``cut`` says the text was stopped at the request's output-token limit."""

    text: str | None
    call: ToolCall | None
    cut: bool
    input_tokens: int
    output_tokens: int

    @property
    def ending(self) -> str:
        """Why the turn ended: "tool_call", "max_tokens" or "stop" (each API names these its own way)."""
        return "tool_call" if self.call else "max_tokens" if self.cut else "stop"


def decide(conversation: Conversation) -> Turn:
    """The deterministic model."""
    input_tokens = len(canonical([conversation.system, conversation.context])) // BYTES_PER_TOKEN
    match = CALL_PATTERN.search(conversation.user_text or "")
    if match and match.group(1) in conversation.functions:
        try:
            arguments = json.loads(match.group(2))
        except ValueError:
            arguments = {}
        output_tokens = max(1, len(canonical(arguments)) // BYTES_PER_TOKEN)
        return Turn(None, ToolCall(match.group(1), arguments), False, input_tokens, output_tokens)
    text = f"I saw {len(conversation.context)} messages; context digest {context_digest(conversation.context)}."
    if conversation.system is not None:
        text += f" System digest {context_digest(conversation.system)}."
    output_tokens = -(-len(text.encode()) // BYTES_PER_TOKEN)
    limit = conversation.max_tokens
    if limit is not None and output_tokens > limit:
        return Turn(text[:limit * BYTES_PER_TOKEN], None, True, input_tokens, limit)
    return Turn(text, None, False, input_tokens, output_tokens)


class ConversationAPI(Protocol):
    """What a protocol module provides: how its API reads a request, shapes the
    model's turn, streams the answer and words its refusals."""

    name: str  # the log's ``protocol``

    def credential(self, call: Call) -> str:
        """The credential the request carries, "" without one."""
        ...

    def missing_credential(self) -> APIError: ...

    def read(self, call: Call) -> Conversation:
        """The request read, or the API's refusal (raised) when it is invalid."""
        ...

    def error(self, status: int) -> APIError:
        """The API's answer when it fails with ``status`` (an injected fault)."""
        ...

    def answer(self, conversation: Conversation, turn: Turn) -> dict:
        """The answer as the API returns it as JSON."""
        ...

    def answer_id(self, answer: dict) -> str: ...

    def output(self, answer: dict) -> list:
        """The answer's message(s), in the API's own shape, for the log."""
        ...

    def stream(self, conversation: Conversation, answer: dict) -> tuple[str, list[bytes]]:
        """The content type and the frames the API streams ``answer`` as."""
        ...
