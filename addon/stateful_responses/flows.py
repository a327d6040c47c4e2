"""What every addon of ours shares on the mitmproxy side: what it keeps on a
flow (the ``flow.metadata`` keys, named here so that no addon reads another's
module for them), how a flow is read into a ``Request``, and how an internal
error is reported (never its message: it could quote a prompt)."""

from __future__ import annotations

import logging
import os
import sys
import traceback
import weakref
from dataclasses import dataclass
from typing import Generic, TypeVar

from mitmproxy import http
from mitmproxy.proxy import mode_specs

from .counters import Counters
from .request_reader import Request
from .tenancy import is_credential_header

logger = logging.getLogger("stateful_responses")

# flow.metadata keys
DECISION = "stateful"  # forward mode's decision about the flow
CLIENT_BODY = "stateful_client_body"  # the client's body, when ours changed it
CONTINUATION = "continuation"  # the flow's continuation record (seed 003)
AUDIT = "audit"  # its protocolMapping audit
EMULATION = "stateful_emulation"  # what store emulation did with the flow
CONVERSATION = "stateful_conversation"  # {"id", "items", …}: a conversation the proxy keeps, expanded into the request
ROUTED = "stateful_routed"  # {"upstream", "reason", "moved", …}: where the router sent it
RETRY_OF = "stateful_retry_of"  # our own retry of the client's flow (its id)
COMPARISON = "stateful_comparison"  # a turn sent whole beside its held continuation, to compare their counts
BRIDGED = "stateful_websocket"  # {"transport", "action", …}: an HTTP request served over an upstream WebSocket
ANSWERED = "stateful_answered"  # the proxy answered this flow itself (compaction): it teaches nothing of the upstream
# A client's upgrade the proxy serves WebSocket mode for itself (its upstream lacks it): {"socket": …}
SERVED_SOCKET = "stateful_client_websocket"
# One response.create of such a socket, sent through the pipeline as an HTTP request: {"socket", "turn", …}
SOCKET_TURN = "stateful_client_websocket_turn"
OVERFLOW = "stateful_websocket_overflow"  # every socket holds a live conversation: HTTP, as without the bridge
# flow.metadata key: an answer held back whole, so that the response hook can
# replace it before the client sees a byte; no addon streams it.
HELD = "stateful_held"
# A body mitmproxy streams, held back whole from the upstream (which gets it empty) because it names state the
# emulations may expand: store emulation sends the request, as the request hooks leave it, in its place.
WITHHELD = "stateful_withheld"


@dataclass(frozen=True)
class Call:
    """One LLM API call as the continuation record saw it, for telemetry:
    counts, names and ids, never content (no prompt, no output, no credential)."""

    protocol: str  # openai-responses, openai-chat, anthropic-messages, gemini-chat
    model: str | None
    chain_id: str  # the record's conversation: stable across turns, restarts and replicas
    response_id: str | None
    status: str | None  # the answer's status (None: no answer)
    status_code: int | None  # the HTTP status the client got (None: a socket turn, or no answer)
    input_tokens: int | None
    output_tokens: int | None
    client_transport: str  # http, or websocket (the client's own socket)
    upstream_transport: str  # http, or websocket (the client's own socket, or the bridge's)
    started: float  # epoch seconds
    ended: float


def hold(flow: http.HTTPFlow) -> None:
    assert flow.response is not None
    flow.response.stream = False
    flow.metadata[HELD] = True


def end_still_to_come(flow: http.HTTPFlow) -> bool:
    """In the response hook: whether the client still waits for this answer's
    end. An answer mitmproxy buffered (held back, or replaced by a hook) goes
    to the client whole only after the hooks, Content-Length or not; a
    streamed one, as ``_streamed_end_after_hooks`` says."""
    assert flow.response is not None
    return not flow.response.stream or _streamed_end_after_hooks(flow)


def _streamed_end_after_hooks(flow: http.HTTPFlow) -> bool:
    """Whether a streamed answer's end reaches the client after the response
    hooks: a chunked stream (SSE), or any answer to an HTTP/2 or HTTP/3
    client, whose stream ends after them. An HTTP/1 answer with a
    Content-Length has reached the client whole already, and waiting would
    only hold back its next request on the connection."""
    assert flow.response is not None
    return "content-length" not in flow.response.headers or not flow.request.http_version.startswith("HTTP/1")


def keep_end_for_hooks(flow: http.HTTPFlow) -> None:
    """Make the client wait for this streamed answer's end until the response
    hooks are done, so that what they write is durable before the client holds
    the whole answer. An HTTP/1.1 answer with a Content-Length goes chunked
    instead (the body's bytes unchanged: the terminating chunk follows the
    hooks); to an HTTP/1.0 client, which has no chunked framing, it goes
    without a length and the connection's close ends it, after the hooks.
    HTTP/2 and HTTP/3 streams end after the hooks anyway."""
    if _streamed_end_after_hooks(flow):
        return
    assert flow.response is not None
    del flow.response.headers["content-length"]
    if flow.request.http_version == "HTTP/1.1":
        flow.response.headers["transfer-encoding"] = "chunked"
    else:
        flow.response.headers["connection"] = "close"


T = TypeVar("T")
_CLIENT_FLOW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # our retry -> the client's flow


def retry_of(retry: http.HTTPFlow, client: http.HTTPFlow) -> None:
    """``retry`` is our second attempt at ``client``'s request."""
    retry.metadata[RETRY_OF] = client.id
    _CLIENT_FLOW[retry] = client


def client_flow(flow: http.HTTPFlow) -> http.HTTPFlow:
    """The client's flow: ``flow`` itself, or the one ``flow`` retries."""
    return _CLIENT_FLOW.get(flow, flow)


class PerFlow(Generic[T]):
    """What an addon keeps about a flow between its hooks, for as long as
    mitmproxy keeps the flow: no count bound that could drop a long-running
    response, and nothing left once mitmproxy lets the flow go."""

    def __init__(self) -> None:
        self._by_flow: weakref.WeakKeyDictionary[http.HTTPFlow, T] = weakref.WeakKeyDictionary()

    def get(self, flow: http.HTTPFlow) -> T | None:
        return self._by_flow.get(flow)

    def put(self, flow: http.HTTPFlow, value: T) -> None:
        self._by_flow[flow] = value

    def pop(self, flow: http.HTTPFlow) -> T | None:
        return self._by_flow.pop(flow, None)

    def __len__(self) -> int:
        return len(self._by_flow)


def _headers_read(fields: tuple[tuple[bytes, bytes], ...]) -> dict[str, str]:
    """The headers the core reads (the credentials and content-encoding), by
    lower-case name, in one pass over the raw fields (a repeated one joined
    as mitmproxy joins it)."""
    found: dict[str, str] = {}
    for name, value in fields:
        key = name.decode("latin-1").lower()
        if key == "content-encoding" or is_credential_header(key):
            text = value.decode("utf-8", "surrogateescape")
            found[key] = f"{found[key]}, {text}" if key in found else text
    return found


def bridge_runs_for(flow: http.HTTPFlow) -> bool:
    """Whether the WebSocket bridge may serve a flow: not in ``--mode
    upstream:``, where its socket would have to go through that proxy, nor one
    its pool turned away because every socket holds a live conversation (that
    conversation goes over HTTP as it would without the bridge)."""
    return not isinstance(flow.client_conn.proxy_mode, mode_specs.UpstreamMode) and OVERFLOW not in flow.metadata


def request_of(flow: http.HTTPFlow, req: http.Request | None = None) -> Request:
    """The pure core's view of a flow's request (or of ``req``, the client's)."""
    req = req or flow.request
    proxy_user = flow.metadata.get("proxyauth")
    headers = _headers_read(req.headers.fields)
    return Request(
        method=req.method,
        url=req.url,
        body=req.raw_content or b"",
        content_encoding=headers.pop("content-encoding", ""),
        headers=headers,
        proxy_user="\x00".join(map(str, proxy_user)) if isinstance(proxy_user, tuple) else "",
    )


def internal_error(counters: Counters, doing: str) -> None:
    """Log where it broke, never the exception's message: a message can
    quote request content (a KeyError of a prompt, say)."""
    counters.errors += 1
    kind, _, tb = sys.exc_info()
    where = traceback.extract_tb(tb)[-1] if tb else None
    logger.warning(
        "stateful-responses: internal error (%s at %s:%s) while %s; flow passed through",
        kind.__name__ if kind else "?",
        os.path.basename(where.filename) if where else "?",
        where.lineno if where else "?",
        doing,
    )
