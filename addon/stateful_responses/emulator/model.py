"""The API's semantics, without HTTP: stored responses, continuation, item
references, background responses, the deterministic model, and fault injection.

This is an oracle for the addon, so it follows the real API (docs/emulator.md
says where from), not the addon: responses are stored per credential;
``previous_response_id`` makes the context the stored chain (every input and
output before) plus this input; ``instructions`` and ``tools`` are not
inherited; unknown or unstored parents get the API's own error body. A
``conversation`` (openai_conversations.py) starts the context with its items
and takes the response's input and output items when it completes.

WebSocket mode (``create_on_socket``) shares that core: a socket keeps its most
recent response in memory (``SocketSession``), so continuing from it needs no
storage; any other parent is read from the store, as over HTTP.

The same model answers the stateless conversation APIs (Chat Completions,
Anthropic Messages, Gemini) through ``converse``, with one log and one fault
queue for all; their modules give each API's shapes (stateless_apis.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import compaction, errors
from .stateless_apis import CALL_PATTERN, Call, Conversation, ConversationAPI, canonical, context_digest, decide
from .errors import APIError
from .openai_conversations import ConversationsCall, OpenAIConversations, StoredConversation
from .shapes import (
    is_item_reference,
    item_list,
    listed_item,
    new_id,
    page_parameters,
    reads_stored_reasoning,
    response_object,
)
from .store import BackgroundJob, ResponseStore, StoredResponse

__all__ = ["APIError", "Faults", "ResponsesModel", "SocketSession", "canonical", "context_digest"]

RESPONSES = "openai-responses"  # the log's ``protocol`` for this API
# The faults the other APIs take; the rest are about Responses' own semantics.
CONVERSATION_FAULTS = frozenset({"status", "reset", "html", "cut", "end"})
# The faults only a WebSocket turn takes; an HTTP request leaves them queued.
SOCKET_ONLY_FAULTS = frozenset({"ws_close", "ws_error", "ws_stall"})
SOCKET_FAULTS = frozenset({"reject", "status", "failed", "incomplete", "stream_error"}) | SOCKET_ONLY_FAULTS
# The faults a GET of a stored response ("retrieve") or of its input items ("input_items") takes, when a
# fault names that endpoint; every other fault is for a create ("create", the default).
ENDPOINT_FAULTS = frozenset({"status", "stall"})


def _text_of(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class Faults:
    """Run-time behaviour set through the control endpoint: injected faults,
    and how fast the emulator reads, answers and finishes background work."""

    stateless: str | None = None  # "reject" (llama.cpp) | "ignore" (Ollama)
    ignore_previous: bool = False  # a previous_response_id is answered from the input alone; storing goes on
    # No Conversations API: "absent" (its paths 404, the field refused) | "ignore" (404, the field dropped) |
    # "not_allowed" (its paths 405, the field dropped)
    conversations: str | None = None
    echo_store: bool = True  # False: answers omit the ``store`` field
    # False: answers omit it; "respelled": another spelling (a gateway's ids); "terminal": on a socket, only the
    # terminal event's response has it (response.created and response.in_progress leave it out)
    echo_previous: bool | str = True
    input_items: str | None = None  # "absent": no ``GET …/input_items`` (its path is 404, as on a server without it)
    refuse_store: bool = False  # a zero-data-retention organization
    forget_probability: float = 0.0
    slow_ms: int = 0  # pause after each SSE event
    think_ms: int = 0  # pause before a model call is answered (a real model's time to its first token)
    gzip: bool = False
    background_delay_ms: int = 200  # a background response's time from queued to finished
    # An upstream without background mode: "refuse" (vLLM without its store: a 400 naming the field), "ignore"
    # (a gateway that drops the field and answers synchronously). A ``stateless`` server ignores it too.
    background: str | None = None
    read_rate_bytes_per_s: int = 0  # request bodies are read at this rate (0: as fast as they come)
    # "refuse": upgrades get 404, as without the mode; "unavailable": 503; "close": accepted, then closed before
    # any event (LiteLLM's native pass-through); "silent": never answered; "no_previous": a socket refuses
    # every previous_response_id
    websocket: str | None = None
    numbered_ids: bool = False  # output item ids numbered from 1 in every response (a server's counter restarted)
    ws_lifetime_s: float = 3600  # a socket's lifetime, after which response.create is refused
    # the code of a response.create refused while its lane runs a response ("response_already_in_flight": a gateway's)
    ws_busy_code: str = "conversation_already_has_active_response"
    # No compaction (compaction.py): "absent" (the endpoint 404, items and the trigger refused) | "not_allowed"
    # (the endpoint 405) | "ignore" (the endpoint 404, compaction items refused, a trigger silently dropped)
    compaction: str | None = None
    # how a socket's error event names its HTTP status: "status" (OpenAI's), "status_code" (Floway's; codex-rs
    # reads either), "none" (left out, as inside a stream)
    ws_error_status: str = "status"
    next: list[dict] = field(default_factory=list)  # one-shot faults, FIFO

    def take(self, continued: bool, protocol: str = RESPONSES, kinds: frozenset[str] | None = None,
             endpoint: str = "create") -> dict | None:
        """The first queued fault that applies: to this protocol (a fault may
        name one) and endpoint, of one of ``kinds`` (None: any but the
        WebSocket-only ones), and to a continuation or a fresh request as its
        ``when`` says."""
        for i, fault in enumerate(self.next):
            kind = fault.get("kind")
            if fault.get("protocol", protocol) != protocol or fault.get("endpoint", "create") != endpoint or (
                    kind in SOCKET_ONLY_FAULTS if kinds is None else kind not in kinds):
                continue
            when = fault.get("when", "any")
            if when == "any" or (when == "continued") == continued:
                return self.next.pop(i)
        return None


SETTABLE = ("stateless", "ignore_previous", "conversations", "echo_store", "echo_previous", "input_items",
            "refuse_store", "forget_probability", "slow_ms", "think_ms", "gzip", "background_delay_ms", "background",
            "read_rate_bytes_per_s", "websocket", "ws_lifetime_s", "numbered_ids", "ws_busy_code", "compaction",
            "ws_error_status")


_SOCKET_NUMBERS = itertools.count(1)


@dataclass
class SocketSession:
    """One WebSocket's state: the credential of its upgrade, its number (the
    log's ``socket``), when it opened, and per lane (``stream_id``; None: the
    default lane) its most recent response (kept in memory: the
    connection-local cache) and the response running on it (one at a time)."""

    credential: str
    number: int = field(default_factory=lambda: next(_SOCKET_NUMBERS))
    opened: float = field(default_factory=time.monotonic)
    latest: dict[Any, StoredResponse] = field(default_factory=dict)
    running: dict[Any, str] = field(default_factory=dict)  # lane -> the response whose events it is sending


class ResponsesModel:
    def __init__(self, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.faults = Faults()
        self._store = ResponseStore()
        self._conversations = OpenAIConversations(self._find_item)
        self._jobs: dict[tuple[str, str], StoredResponse] = {}  # background responses not finished yet
        self.log: list[dict] = []

    # -- control -------------------------------------------------------------

    def control(self, command: dict) -> dict:
        with self._lock:
            if command.get("reset"):  # first: settings in the same command apply to the fresh state
                self._store.clear()
                self._conversations.clear()
                self._jobs.clear()
                self.log.clear()
                self.faults = Faults()
            for key in SETTABLE:
                if key in command:
                    setattr(self.faults, key, command[key])
            if "fail_next" in command:
                self.faults.next.extend(command["fail_next"])
            for response_id in command.get("forget", []):
                self._store.forget(response_id)
            if command.get("forget_all"):
                self._store.clear()
                self._jobs.clear()
            return {"stored": self._store.continuable_count(), "log": len(self.log)}

    def record_stream(self, response_id: str, sent: bytes) -> None:
        """Keep the exact event-stream bytes sent for a response (before any
        content-encoding), so tests can compare them with what a client got."""
        self._record_sent(response_id, "sse", sent.decode())

    def record_messages(self, response_id: str, messages: list[str]) -> None:
        """Keep the WebSocket messages sent for a response so far, one JSON text each."""
        self._record_sent(response_id, "messages", list(messages))

    def _record_sent(self, response_id: str, key: str, sent: Any) -> None:
        with self._lock:
            for record in reversed(self.log):
                if record.get("response_id") == response_id:
                    record[key] = sent
                    return

    def snapshot_log(self) -> list[dict]:
        with self._lock:
            self._advance_background()
            return list(self.log)

    # -- POST /responses, and response.create on a WebSocket -------------------

    def create(self, credential: str, body: Any, body_bytes: int, raw_sha256: str = "",
               encoding: str = "") -> tuple[dict, dict | None]:
        """Validate, resolve context, answer. Returns (response, one-shot fault).
        ``body_bytes`` counts the decoded body; ``raw_sha256`` and ``encoding``
        (logged when there is one) tell the bytes that arrived.

        Raises APIError with the API's status and body for refused requests.
        """
        record = _record(RESPONSES, "http", credential, body_bytes, raw_sha256)
        if encoding:
            record["body_encoding"] = encoding
        return self._logged(record, lambda: self._create(credential, body, record))

    def create_on_socket(self, socket: SocketSession, message: Any, message_bytes: int,
                         sha256: str) -> tuple[dict, dict | None]:
        """A message received on a WebSocket, answered as ``create`` answers
        the same body over HTTP, with the socket's own rules: only
        ``response.create``, one response at a time, a lifetime limit, no
        background, ``generate: false`` (a warm-up without output), and the
        socket's most recent response as a parent that needs no storage.

        A refused turn evicts that response (a socket continues only from a
        turn that completed); a refusal because another turn is running does
        not, as that turn is still to finish.
        """
        record = _record(RESPONSES, "websocket", socket.credential, message_bytes, sha256)
        record["socket"] = socket.number
        return self._logged(record, lambda: self._create_on_socket(socket, message, record))

    def _logged(self, record: dict, create: Callable[[], tuple[dict, dict | None]]) -> tuple[dict, dict | None]:
        """Run ``create`` under the lock with ``record`` in the log, noting how it was answered."""
        with self._lock:
            self._advance_background()
            self.log.append(record)
            try:
                answer = create()
            except APIError as e:
                record["error"] = e.body["error"]
                record["status_code"] = e.status
                raise
            record["status_code"] = 200
            return answer

    def _create_on_socket(self, socket: SocketSession, message: Any, record: dict) -> tuple[dict, dict | None]:
        lane = message.get("stream_id") if isinstance(message, dict) else None
        record["stream_id"] = lane
        if (running := socket.running.get(lane)) is not None:
            raise errors.response_in_progress(running, self.faults.ws_busy_code)
        try:
            if not isinstance(message, dict):
                raise errors.unparsable_json()
            if message.get("type") != "response.create":
                raise errors.unknown_client_event(message.get("type"))
            if time.monotonic() - socket.opened >= self.faults.ws_lifetime_s:
                raise errors.websocket_connection_limit_reached()
            body = {key: value for key, value in message.items() if key not in ("type", "stream_id")}
            return self._create(socket.credential, body, record, socket, lane)
        except APIError:
            socket.latest.pop(lane, None)
            raise

    def steered(self, response: dict) -> None:
        """A response that steering ended, at its output's end: incomplete
        (``steered``), yet still its lane's latest and continuable, stored as
        such when it was stored: the server's successor continues from it."""
        with self._lock:
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "steered"}

    def _create(self, credential: str, body: Any, record: dict,
                socket: SocketSession | None = None, lane: Any = None) -> tuple[dict, dict | None]:
        if not credential:
            raise errors.missing_api_key()
        if not isinstance(body, dict):
            raise errors.unparsable_json()
        model = body.get("model")
        if not isinstance(model, str):
            raise errors.missing_model()
        items = _input_of(body)
        previous = body.get("previous_response_id")
        store = body.get("store", True)
        background = body.get("background") is True
        if background and socket is None and self.faults.background == "refuse":
            raise errors.background_unsupported()
        if self.faults.background == "ignore" or self.faults.stateless is not None:
            body = {key: value for key, value in body.items() if key != "background"}  # dropped, answered at once
            background = False
        streamed = socket is not None or bool(body.get("stream"))  # a socket always streams
        generate = socket is None or body.get("generate") is not False  # a socket's warm-up generates nothing
        f = self.faults
        record.update(input_items=len(items), previous_response_id=previous, stream=streamed,
                      store=store, instructions=body.get("instructions"), model=model, background=background,
                      conversation=_conversation_id(body.get("conversation")))
        if socket is not None:
            record["generate"] = generate
            if background:
                raise errors.background_over_websocket()
            if previous is not None and f.websocket == "no_previous":
                raise APIError(400, "previous_response_id is not supported over this socket.",
                               param="previous_response_id")

        conversation = self._conversation_of(credential, body, previous)
        if f.refuse_store and body.get("store") is True:
            raise APIError(400, "Store must be false for this organization due to Zero Data Retention.", param="store")
        parent = None
        if previous is not None:
            if f.stateless == "reject":
                raise APIError(400, "This server does not support 'previous_response_id'.")
            if f.stateless != "ignore" and not f.ignore_previous:
                parent = self._parent(credential, previous, socket, store)
        if socket is not None:
            record["hydrated"] = parent is not None and all(parent is not r for r in socket.latest.values())
        items, references = self._resolve_references(credential, items, store is not False)
        triggered = compaction.triggered(items)
        items = self._compaction_checked(credential, items)
        if self.faults.stateless is None:
            _refuse_duplicates(items, conversation.items if conversation else [])
        fault = f.take(continued=parent is not None, protocol=RESPONSES,
                       kinds=SOCKET_FAULTS if socket is not None else None)
        kind = fault.get("kind") if fault else None
        record["fault"] = kind
        if kind == "reject":
            raise APIError(fault.get("status", 400), fault.get("message", "Invalid `previous_response_id`."),
                           code=fault.get("code", "invalid_request_error"))
        if kind == "status":
            raise errors.server_error(fault.get("status", 500))
        if kind == "ws_error":
            raise errors.injected(fault)
        if kind == "stream_error":
            if not streamed:
                raise errors.server_error()
            record["error"] = dict(errors.STREAM_ERROR)

        before = parent.chain if parent else list(conversation.items) if conversation else []
        context = before + items
        record.update(continued=parent is not None, references=references, context=context,
                      context_digest=context_digest(context))
        own_items = [listed_item(i) for i in items]
        listed = (parent.input_items + parent.response["output"] if parent else before) + own_items
        conversation_id = conversation.id if conversation else None
        response_id, created_at = new_id("resp"), int(time.time())
        record["response_id"] = response_id
        if background:
            response = response_object(body, response_id=response_id, created_at=created_at, status="queued",
                                       output=[], previous=previous, usage=None, store=self._store_echo(store),
                                       conversation=conversation_id)
            job = BackgroundJob(body, context, fault, record, time.monotonic(), f.background_delay_ms / 1000,
                                conversation_id, own_items)
            stored = StoredResponse(response, chain=[], input_items=listed, continuable=False, job=job)
            self._store.put(credential, stored)
            self._jobs[(credential, response_id)] = stored
            record.update(stored=False, output=[])
            return response, fault
        response = self._answer(body, response_id, created_at, context, fault, conversation_id, generate)
        if response["status"] == "completed" and f.compaction is None and generate:
            if triggered:  # the window compacted, and nothing else
                response["output"] = [compaction.compaction_item(credential, context)]
            elif compaction.threshold_passed(body, response["usage"]["input_tokens"]):
                response["output"].insert(0, compaction.compaction_item(credential, context))
        completed = response["status"] == "completed"
        keep = self._stores(store) and completed
        if self._stores(store):
            self._store.put(credential, StoredResponse(response, context + response["output"], listed, keep))
        if socket is not None and completed:  # the lane remembers its latest response, stored or not, if it completed
            socket.latest[lane] = StoredResponse(response, context + response["output"], listed, True)
        elif socket is not None:
            socket.latest.pop(lane, None)
        _append_completed(conversation, own_items, response)
        record.update(stored=keep, output=response["output"])
        return response, fault

    def _compaction_checked(self, credential: str, items: list) -> list:
        """The input as the model reads it: a trigger checked and left out,
        each compaction item verified as this server's (see compaction.py)."""
        items = compaction.check_input(items, self.faults.compaction)
        for item in items:
            if item.get("type") in compaction.COMPACTION_TYPES:
                compaction.verify(credential, item)
        return items

    def compact(self, credential: str, body: Any, body_bytes: int, raw_sha256: str = "") -> dict:
        """``POST /v1/responses/compact``: the window (a stored chain, then the
        input) compacted into its user messages and one compaction item. Logged
        as a create is, with ``endpoint: "compact"``."""
        record = _record(RESPONSES, "http", credential, body_bytes, raw_sha256)
        record["endpoint"] = "compact"

        def answer() -> tuple[dict, None]:
            if not credential:
                raise errors.missing_api_key()
            if not isinstance(body, dict):
                raise errors.unparsable_json()
            if not isinstance(body.get("model"), str):
                raise errors.missing_model()
            previous = body.get("previous_response_id")
            items = _input_of(body) if body.get("input") is not None else []
            parent = self._parent(credential, previous) if previous is not None else None
            items, _ = self._resolve_references(credential, items, True)
            items = self._compaction_checked(credential, items)
            context = (parent.chain if parent else []) + items
            record.update(input_items=len(items), previous_response_id=previous, model=body["model"],
                          instructions=body.get("instructions"), context=context,
                          context_digest=context_digest(context))
            usage = _usage(context, [])
            return compaction.compacted_response(body, context, [listed_item(i) for i in context], credential,
                                                 int(time.time()), usage), None

        return self._logged(record, answer)[0]

    def _conversation_of(self, credential: str, body: dict, previous: Any) -> StoredConversation | None:
        """The conversation a create names, as this upstream reads the field:
        OpenAI's API (with ``previous_response_id`` it is a 400), one without the
        API (``absent``: an unknown field), or one that drops it (``ignore``, ``not_allowed``)."""
        named = body.get("conversation")
        if named is None or self.faults.conversations in ("ignore", "not_allowed"):
            return None
        if self.faults.conversations == "absent":
            raise errors.unknown_parameter("conversation")
        if previous is not None:
            raise errors.conversation_with_previous_response()
        conversation_id = _conversation_id(named)
        if not isinstance(conversation_id, str):
            raise errors.invalid_type("conversation", "one of a string or an object", named)
        return self._conversations.get(credential, conversation_id)

    def _find_item(self, credential: str, item_id: str) -> dict | None:
        """A stored item of this credential: a continuable response's, or a conversation's."""
        return self._store.find_item(credential, item_id) or self._conversations.find_item(credential, item_id)

    def _stores(self, store: Any) -> bool:
        """Whether this upstream keeps what a request with ``store`` asks it to."""
        return store is not False and self.faults.stateless is None and not self.faults.refuse_store

    def _store_echo(self, store: Any) -> bool | None:
        return self._stores(store) if self.faults.echo_store else None

    def _parent(self, credential: str, previous: Any, socket: SocketSession | None = None,
                store: Any = True) -> StoredResponse:
        """The response ``previous`` names: a socket's most recent one from the
        socket's memory; otherwise a continuable stored one, which a socket
        reads (hydrates) only for a request with ``store`` not false."""
        if socket is not None and (cached := next((r for r in socket.latest.values()
                                                    if r.response["id"] == previous), None)) is not None:
            return cached  # the connection-local cache: any lane's latest (a fork on another lane)
        if socket is not None and store is False:
            raise errors.previous_response_not_found(previous)
        stored = self._store.get(credential, previous)
        if stored is not None and not stored.continuable:
            stored = None
        forget = self.faults.forget_probability
        if stored is not None and forget and self._rng.random() < forget:
            self._store.pop(credential, previous)
            stored = None
        if stored is None:
            raise errors.previous_response_not_found(previous)
        return stored

    def _resolve_references(self, credential: str, items: list, store: bool) -> tuple[list, int]:
        """Each item reference replaced by the stored item it names (an output
        or input item of this credential's stored responses): what the model sees.

        A reasoning item with an id and no ``encrypted_content`` must name a
        stored item too: the API reads that reasoning from storage, so an id it
        never kept (a ``store: false`` response, a forgotten one) is refused
        as an unknown reference is. With ``encrypted_content`` the item carries
        its reasoning and is taken as sent (Codex's ``store: false`` way).
        Servers that keep no state (the ``stateless`` faults) look nothing up."""
        resolved, references = [], 0
        for item in items:
            if not is_item_reference(item):
                if (reads_stored_reasoning(item) and self.faults.stateless is None
                        and self._find_item(credential, item["id"]) is None):
                    raise errors.item_not_found(item["id"], request_store=store)
                resolved.append(item)
                continue
            found = self._find_item(credential, item["id"])
            if found is None:
                raise errors.item_not_found(item["id"], request_store=store)
            resolved.append(found)
            references += 1
        return resolved, references

    def _answer(self, body: dict, response_id: str, created_at: int, context: list, fault: dict | None,
                conversation_id: str | None, generate: bool = True) -> dict:
        """The finished response to ``body`` over ``context``, shaped by a fault;
        without output when it is not to ``generate``."""
        encoded = canonical(context)
        output = self._generate(body, context, hashlib.sha256(encoded).hexdigest()[:16]) if generate else []
        kind = (fault or {}).get("kind")
        status = {"failed": "failed", "incomplete": "incomplete", "stream_error": "failed"}.get(kind, "completed")
        if status == "failed":
            output = []
        elif status == "incomplete" and output and "status" in output[-1]:
            output[-1]["status"] = "incomplete"  # cut short, as the last item is when the budget runs out
        usage = _usage(context, output)
        response = response_object(body, response_id=response_id, created_at=created_at, status=status,
                                   output=output, previous=body.get("previous_response_id"), usage=usage,
                                   store=self._store_echo(body.get("store", True)), conversation=conversation_id)
        if not self.faults.echo_previous:
            del response["previous_response_id"]
        elif self.faults.echo_previous == "respelled" and isinstance(response["previous_response_id"], str):
            response["previous_response_id"] = "resp_" + hashlib.sha256(response["previous_response_id"].encode()
                                                                        ).hexdigest()[:40]
        return response

    def _generate(self, body: dict, context: list, digest: str) -> list:
        """The deterministic model. It calls a tool when the newest user
        message says ``call:NAME({json})`` and NAME is an offered function;
        otherwise it answers with ``digest``, the context's: a digest of
        exactly the context it saw."""
        last = context[-1] if context else {}
        output: list = []
        numbers = itertools.count(1)
        item_id = (lambda prefix: f"{prefix}_{next(numbers)}") if self.faults.numbered_ids else new_id
        reasoning_request = body.get("reasoning")
        if isinstance(reasoning_request, dict):
            reasoning: dict[str, Any] = {"type": "reasoning", "id": item_id("rs"), "summary": []}
            if reasoning_request.get("summary"):
                reasoning["summary"] = [{"type": "summary_text", "text": f"Read {len(context)} items."}]
            if "reasoning.encrypted_content" in (body.get("include") or []):
                reasoning["encrypted_content"] = "enc_" + digest
            output.append(reasoning)
        tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"}
        match = CALL_PATTERN.search(_text_of(last)) if last.get("role") == "user" else None
        if match and match.group(1) in tools:
            try:
                args = json.loads(match.group(2))
            except ValueError:
                args = {}
            output.append({
                "type": "function_call", "id": item_id("fc"), "call_id": new_id("call"),
                "name": match.group(1), "arguments": json.dumps(args), "status": "completed",
            })
            return output
        text = f"I saw {len(context)} items; context digest {digest}."
        if body.get("instructions"):
            # surrogatepass: a lone surrogate the client escaped is text the API accepts
            instructions = str(body["instructions"]).encode("utf-8", "surrogatepass")
            text += f" Instructions digest {hashlib.sha256(instructions).hexdigest()[:8]}."
        output.append({
            "type": "message", "id": item_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        })
        return output

    # -- the other conversation APIs (chat.py, anthropic.py, gemini.py) -------

    def converse(self, api: ConversationAPI, call: Call) -> tuple[dict, Conversation, dict | None]:
        """Answer one request to another API with the same deterministic model,
        logged like ``create``. Returns (answer, conversation, one-shot fault);
        raises APIError with that API's status and body for refused requests."""
        credential = api.credential(call)
        record = _record(api.name, "http", credential, call.body_bytes, call.body_sha256)
        with self._lock:
            self._advance_background()
            self.log.append(record)
            try:
                if not credential:
                    raise api.missing_credential()
                conversation = api.read(call)
                record.update(model=conversation.model, stream=conversation.stream, system=conversation.system)
                fault = self.faults.take(continued=False, protocol=api.name, kinds=CONVERSATION_FAULTS)
                record["fault"] = fault.get("kind") if fault else None
                if record["fault"] == "status":
                    raise api.error(fault.get("status", 500))
                record.update(context=conversation.context, context_digest=context_digest(conversation.context))
                answer = api.answer(conversation, decide(conversation))
                record.update(response_id=api.answer_id(answer), output=api.output(answer))
            except APIError as e:
                record.update(error=e.body["error"], status_code=e.status)
                raise
            record["status_code"] = 200
            return answer, conversation, fault

    # -- background responses ------------------------------------------------

    def _advance_background(self) -> None:
        """Move every background response to the state its age gives it."""
        now = time.monotonic()
        for key, stored in list(self._jobs.items()):
            credential, response_id = key
            job = stored.job
            if job is None or self._store.get(credential, response_id) is not stored:
                del self._jobs[key]  # cancelled, deleted or forgotten meanwhile
                continue
            status = job.status_at(now)
            if status == "finished":
                del self._jobs[key]
                self._finish(credential, stored, job)
            elif status != stored.response["status"]:
                stored.response = {**stored.response, "status": status}

    def _finish(self, credential: str, stored: StoredResponse, job: BackgroundJob) -> None:
        response = self._answer(job.body, stored.response["id"], stored.response["created_at"], job.context, job.fault,
                                job.conversation_id)
        _append_completed(self._conversations.find(credential, job.conversation_id), job.own_items, response)
        stored.response = response
        stored.chain = job.context + response["output"]
        stored.continuable = self._stores(job.body.get("store", True)) and response["status"] == "completed"
        stored.job = None
        job.record.update(stored=stored.continuable, output=response["output"])

    # -- the other endpoints -------------------------------------------------

    def _find(self, credential: str, response_id: str) -> StoredResponse:
        if not credential:
            raise errors.missing_api_key()
        self._advance_background()
        stored = self._store.get(credential, response_id)
        if stored is None:
            raise errors.response_not_found(response_id)
        return stored

    def answers_background_at_once(self) -> bool:
        """Whether ``background: true`` is answered without the model's time:
        queued (honoured here), or refused when the request is validated (vLLM);
        a server that drops or ignores the field answers it as any other."""
        return self.faults.background in (None, "refuse") and self.faults.stateless is None

    def retrieve(self, credential: str, response_id: str) -> dict:
        """``GET /responses/{id}``: the response as it stands now."""
        with self._lock:
            return self._find(credential, response_id).response

    def delete(self, credential: str, response_id: str) -> dict:
        with self._lock:
            self._find(credential, response_id)
            self._store.pop(credential, response_id)
            return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, credential: str, response_id: str) -> dict:
        """Only a background response can be cancelled; cancelling a finished
        one returns it unchanged (the API documents cancel as idempotent)."""
        with self._lock:
            stored = self._find(credential, response_id)
            if not stored.response["background"]:
                raise errors.not_cancellable()
            if stored.job is not None:
                stored.job.record.update(stored=False, output=[])
                stored.job = None
                stored.response = {**stored.response, "status": "cancelled"}
            return stored.response

    def conversations_endpoint(self, endpoint: str, credential: str, call: ConversationsCall) -> dict:
        """One endpoint of the Conversations API (the ``OpenAIConversations``
        method of that name) for ``credential``. Background responses are brought
        up to date first, so a finished one has joined its conversation."""
        with self._lock:
            if not credential:
                raise errors.missing_api_key()
            self._advance_background()
            return getattr(self._conversations, endpoint)(credential, call)

    def endpoint_fault(self, endpoint: str) -> dict | None:
        """The first queued fault for a GET of ``endpoint`` (``retrieve`` or ``input_items``)."""
        with self._lock:
            return self.faults.take(continued=False, kinds=ENDPOINT_FAULTS, endpoint=endpoint)

    def list_input_items(self, credential: str, response_id: str, query: dict[str, str]) -> dict:
        """``GET /responses/{id}/input_items``: every item the response was
        generated from (a continuation's too), a page at a time."""
        with self._lock:
            stored = self._find(credential, response_id)
            limit, order = page_parameters(query)
            items = stored.input_items if order == "asc" else stored.input_items[::-1]
            ids = [item["id"] for item in items]
            start, end = 0, len(items)
            for cursor in ("after", "before"):
                if cursor in query and query[cursor] not in ids:
                    raise errors.item_not_found(query[cursor], param=cursor)
            if "after" in query:
                start = ids.index(query["after"]) + 1
            if "before" in query:
                end = ids.index(query["before"])
            window = items[start:end]
            page = window[-limit:] if "before" in query and "after" not in query else window[:limit]
            return item_list(page, has_more=len(window) > len(page))


def _append_completed(conversation: StoredConversation | None, own_items: list, response: dict) -> None:
    """A completed response's input items, then its output items, join its
    conversation in one step (the caller holds the model's lock)."""
    if conversation is not None and response["status"] == "completed":
        conversation.items.extend(own_items + response["output"])


def _refuse_duplicates(items: list, present: list) -> None:
    """The API's 400 for an input item whose id is already in the conversation
    (``present``) or earlier in the input, references resolved: no id is in a
    context twice."""
    seen = {item["id"] for item in present}
    for item in items:
        item_id = item.get("id")
        if isinstance(item_id, str) and item_id:
            if item_id in seen:
                raise errors.duplicate_item(item_id)
            seen.add(item_id)


def _conversation_id(named: Any) -> Any:
    """The id in a ``conversation`` field: the id itself or ``{"id": …}``."""
    return named.get("id") if isinstance(named, dict) else named


def _credential_hash(credential: str) -> str:
    """What the log keeps of a credential: enough to tell tenants apart."""
    return hashlib.sha256(credential.encode()).hexdigest()[:8]


def _record(protocol: str, transport: str, credential: str, body_bytes: int, body_sha256: str) -> dict[str, Any]:
    """A log record's opening: which API and transport, what arrived, from whom."""
    return {"protocol": protocol, "transport": transport, "body_bytes": body_bytes, "body_sha256": body_sha256,
            "credential": _credential_hash(credential)}


def _input_of(body: dict) -> list:
    """The request's input as items; a string is one user message."""
    raw_input = body.get("input", [])
    if isinstance(raw_input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw_input}]}]
    if isinstance(raw_input, list) and all(isinstance(i, dict) for i in raw_input):
        return raw_input
    raise errors.invalid_input_type()


# What a model reads of an item is its content: ids, statuses and empty fields are the API's bookkeeping.
_BOOKKEEPING = frozenset({"id", "status", "created_at", "completed_at"})


def _as_read(value: Any, top: bool = False) -> Any:
    """``value`` as the model reads it: without bookkeeping or nulls, a
    message's text parts as their text (a string content is one)."""
    if isinstance(value, list):
        return [_as_read(v) for v in value]
    if not isinstance(value, dict):
        return value
    if value.get("type") in ("input_text", "output_text") and isinstance(value.get("text"), str):
        return value["text"]
    return {k: _as_read(v) for k, v in value.items()
            if v is not None and not (top and k in _BOOKKEEPING) and k not in ("annotations", "logprobs")}


def _tokens(items: list) -> int:
    """Tokens of items as the model reads them, about 4 bytes a token. A
    reasoning item reads as nothing: its tokens were billed as output once and
    are not fed back (OpenAI's reasoning guide)."""
    read = []
    for item in items:
        if not isinstance(item, dict) or item.get("type") == "reasoning":
            continue
        try:
            item = _as_read(item, top=True)
        except RecursionError:  # nested past any sense: read as it is
            pass
        if isinstance(item.get("content"), str):
            item["content"] = [item["content"]]
        item.setdefault("type", "message")
        read.append(item)
    return len(canonical(read)) // 4 if read else 0


def _usage(context: list, output: list) -> dict:
    """Token counts that grow with what was read and written, as OpenAI
    bills them: a continuation's input is its chain's input and output, less
    the reasoning tokens (not fed back), plus its new items."""
    input_tokens = _tokens(context)
    reasoning_tokens = 8 if any(item.get("type") == "reasoning" for item in output) else 0
    output_tokens = _tokens(output) + reasoning_tokens
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}
