"""What became of a Responses API request, read off what the capabilities put
on its flow: one decision, one transport, the fallbacks it took. Pure: the
glue hands over the flow's metadata entries, plain dicts.

The contract (docs/operators.md): a capability that serves a request some new
way says so in the flow metadata the others read already (``stateful`` for a
plan, ``stateful_websocket`` for a transport, ``stateful_emulation`` and
``stateful_conversation`` for what the proxy expanded or answered, …), and is
counted here without a hook of its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DECISIONS = ("continued", "full", "passed", "expanded", "answered")
TRANSPORTS = ("http", "websocket")
# Every reason a fallback is counted under: a fixed set (a metric's label values).
FALLBACKS = (
    "continuation_refused",  # the upstream refused a continuation: the client's body went again
    "continuation_unverified",  # a checked continuation's answer did not show the chain was read: sent again
    "previous_id_refused",  # the upstream refused a client's previous_response_id: sent again with the chain expanded
    "expansion_refused",  # the upstream refused an expanded chain: the client's own body went again
    "socket_gave_up",  # the upstream WebSocket could not answer: the client's request went over HTTP
    "socket_retried",  # a socket failed or refused, the turn answered on another one
    "sockets_full",  # every socket held a live conversation: over HTTP, as without the bridge
    "failed_over",  # the router sent the turn to another upstream with full history
    "conversation_taken_over",  # the upstream failed a conversation call: the proxy answered it
    "upstream_unsupported",  # a proof or an answer showed an upstream + credential keeps no state: passed from then on
    "ambiguous_body",  # JSON that parsers read differently: passed untouched
    "internal_error",  # an error inside the addon: the flow passed as the client sent it
)
# A Responses API path (the Conversations API's included), under any base path.
_RESPONSES_API = re.compile(r"/(?:responses(?:/[^/]+(?:/(?:input_items|cancel))?)?"
                            r"|conversations(?:/[^/]+(?:/items(?:/[^/]+)?)?)?)/?$")


def is_responses_api(path: str) -> bool:
    """Whether ``path`` (without its query) is one of the Responses API's endpoints."""
    return _RESPONSES_API.search(path) is not None


@dataclass(frozen=True)
class Counted:
    decision: str
    transport: str
    fallbacks: tuple[str, ...]


def classify(decision: Mapping, bridged: Mapping, emulated: Mapping, conversation: Mapping, routed: Mapping,
             overflow: bool, answered: bool) -> Counted:
    """The decision about a client's request, as it finally went: ``decision``
    is forward mode's plan (``stateful``), ``bridged`` the bridge's
    (``stateful_websocket``), ``emulated`` and ``conversation`` store and
    conversation emulation's, ``routed`` the router's; ``overflow``: the pool
    turned it away; ``answered``: the proxy answered it, the upstream never
    had it (or had its answer replaced by the proxy's own)."""
    failed_over = bool(routed.get("failed_over_to"))
    over_socket = bridged.get("transport") == "websocket" and not failed_over
    fallbacks = []
    if decision.get("retried_after"):
        fallbacks.append("continuation_unverified" if decision.get("retry_reason") else "continuation_refused")
    if emulated.get("retried_after"):
        fallbacks.append("previous_id_refused" if emulated.get("expanded") else "expansion_refused")
    if bridged.get("transport") == "http":
        fallbacks.append("socket_gave_up")
    elif bridged.get("retries"):
        fallbacks.append("socket_retried")
    if overflow:
        fallbacks.append("sockets_full")
    if failed_over:
        fallbacks.append("failed_over")
    if conversation.get("taken_over_after"):
        fallbacks.append("conversation_taken_over")
    answered = answered or any(k in emulated for k in ("error", "deleted", "not_deleted")) \
        or any(k in conversation for k in ("endpoint", "taken_over_after"))
    if answered:
        kind = "answered"
    elif emulated.get("expanded") or emulated.get("references_expanded") or conversation.get("id"):
        kind = "expanded"
    elif over_socket:
        kind = "continued" if bridged.get("action") == "continue" else "full"
    elif decision.get("action") == "continue" and not decision.get("retried_after") and not failed_over:
        kind = "continued"
    elif decision.get("action") in ("continue", "full") or bridged or failed_over:
        kind = "full"
    else:
        kind = "passed"
    return Counted(kind, "websocket" if over_socket else "http", tuple(fallbacks))


class Hosts:
    """Upstream label values: a host name as it is, up to ``limit`` of them
    (first come); past that, ``other``. Bounded whatever the traffic."""

    OTHER = "other"

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def label(self, host: str) -> str:
        host = host.lower()
        if host in self._known:
            return host
        if len(self._known) >= self.limit or not host:
            return self.OTHER
        self._known.add(host)
        return host
