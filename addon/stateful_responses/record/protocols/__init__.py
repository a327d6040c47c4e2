"""Lifters: every LLM API call as a conversation, whatever its protocol.

For each of four protocols, a request is lifted into its conversation messages
(oldest first) and an answer into the message(s) a client echoes back in its
next request, both in that protocol's comparison normal form. A request whose
messages extend an earlier request's messages plus that request's answer
continues its conversation: the normal forms are what makes a real client's
echo compare equal to the answer it echoes, and only that.

Pure: never imports mitmproxy. Nothing here raises on any input; what cannot
be read lifts to None.

The shared types live in ``common`` so that the protocol modules and this
dispatch can both import them.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from . import anthropic, chat, gemini, responses
from .common import AuditEntry, LiftedAnswer, LiftedRequest, Protocol, ToolResult, parse_json

__all__ = [
    "AnswerLifter",
    "AuditEntry",
    "LiftedAnswer",
    "LiftedRequest",
    "Protocol",
    "ToolResult",
    "detect",
    "lift_request",
]

MODULES: dict[str, Any] = {
    "openai-responses": responses,
    "openai-chat": chat,
    "anthropic-messages": anthropic,
    "gemini-chat": gemini,
}


def detect(method: str, url: str) -> Protocol | None:
    """The protocol of a request, by its endpoint; None for anything else."""
    try:
        if method.upper() != "POST":
            return None
        path = urlsplit(url).path.rstrip("/")
        for protocol, module in MODULES.items():
            if module.matches(path):
                return protocol  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - never raises
        pass
    return None


def lift_request(protocol: Protocol, url: str, body: bytes) -> LiftedRequest | None:
    """The request's conversation; None if ``body`` is not this protocol's JSON."""
    try:
        module = MODULES.get(protocol)
        return module.lift_request(url, parse_json(body)) if module else None
    except Exception:  # noqa: BLE001 - never raises
        return None


class AnswerLifter:
    """Reads one answer incrementally: ``event`` for each SSE event (as
    ``sse.SSEParser`` frames them), or ``body`` once with the whole decoded
    body (a JSON answer, and Gemini's streamed JSON array). Whichever is fed
    says what the answer is. Anything unreadable makes ``finish`` None."""

    def __init__(self, protocol: Protocol) -> None:
        module = MODULES.get(protocol)
        self._answer: Any = module.Answer() if module else None

    def event(self, name: str, data: str) -> None:
        if self._answer is not None:
            try:
                self._answer.event(name, data)
            except Exception:  # noqa: BLE001 - never raises: give up on this answer
                self._answer = None

    def body(self, data: bytes) -> None:
        if self._answer is not None:
            try:
                self._answer.body(parse_json(data))
            except Exception:  # noqa: BLE001
                self._answer = None

    @property
    def complete(self) -> bool:
        """The answer is final: what follows cannot change the lifted messages."""
        try:
            return self._answer is not None and bool(self._answer.complete)
        except Exception:  # noqa: BLE001
            return False

    def finish(self) -> LiftedAnswer | None:
        try:
            return self._answer.finish() if self._answer is not None else None
        except Exception:  # noqa: BLE001
            return None
