"""Background responses run by the proxy for upstreams without background
mode: a job's ids, its event log, its state read off that log, and resuming
it. Pure: no mitmproxy, no I/O (the writes go out through an outbox).

A job is one append-only log in the state store (``state.storage``: appends
are numbered by the store, so a replica cancelling or failing a job and the
replica running it never overwrite each other). Its first entry is the
job's head (the queued response and whether it was streamed); every later
entry is the events one upstream chunk gave, relabelled as the API streams
a background response (its id, ``background: true``), or a cancel mark.
Sequence numbers are counted, never stored: every reader on every replica
numbers the same log alike, so a resume after any event has no gap and no
duplicate. The first terminal event (or cancel mark) decides the outcome;
anything appended after it is never served.

Entries are sealed per tenant (``store_emulation.turns.Tenant``), under a
key another tenant cannot name: a job of another credential is "not found".
A lease record (clear: an expiry time, nothing else) says the job's process
is alive; a job found unfinished without one is failed by whoever reads it.
"""

from __future__ import annotations

import json
import secrets
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from ..settings import Config
from ..state.outbox import Outbox, Write
from ..state.storage import log_entry, log_length
from ..store_emulation.turns import Tenant

JOBS = "background-jobs"  # job key -> its log (length record, then sealed entries)
LEASES = "background-leases"  # job key -> the time its process's lease ends (clear, 8 bytes)

MAX_EVENTS = 100_000  # events one job keeps at most: an answer beyond is failed, as one the proxy cannot hold
MAX_BYTES = 64 * 1024 * 1024  # bytes of sealed entries one job keeps at most
MAX_RUN_S = 3 * 3600.0  # a job still running by then is abandoned (failed)
UNSTORED_TTL = MAX_RUN_S + 600.0  # seconds a ``store: false`` job is kept: its run, then ten minutes to poll it
TAIL = 8  # entries read from a log's end for its outcome: a terminal event is the last, or nearly
TERMINAL = {"response.completed": "completed", "response.failed": "failed", "response.incomplete": "incomplete"}
LIFECYCLE = frozenset({"response.created", "response.queued", "response.in_progress"})
_ID_CHECK = b"stateful-responses background job id"


def mint_id() -> str:
    """A response id the proxy owns, shaped as the API's (``resp_`` and 48 hex
    digits); its last 16 digits check the first 32, so that the proxy tells its
    own ids from an upstream's without a lookup."""
    random_part = secrets.token_hex(16)
    return f"resp_{random_part}{_check(random_part)}"


def is_ours(response_id: object) -> bool:
    if not isinstance(response_id, str) or len(response_id) != 53 or not response_id.startswith("resp_"):
        return False
    return secrets.compare_digest(response_id[-16:], _check(response_id[5:37]))


def _check(random_part: str) -> str:
    return blake3(random_part.encode(), key=blake3(_ID_CHECK).digest()).hexdigest(8)


def _given(body: dict, key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def queued_response(body: dict, job_id: str, created_at: int) -> dict:
    """The Response object a background create is answered with at once: the
    request's settings echoed, ``status: queued``, ``background: true``, no
    output and no usage yet."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None
    return {
        "id": job_id, "object": "response", "created_at": created_at, "status": "queued", "background": True,
        "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"), "model": body.get("model"), "output": [],
        "parallel_tool_calls": _given(body, "parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")} if reasoning
        else {"effort": None, "summary": None},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": _given(body, "service_tier", "auto"),
        "store": body.get("store") is not False,
        "temperature": body.get("temperature"), "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": _given(body, "tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"), "top_p": body.get("top_p"),
        "truncation": _given(body, "truncation", "disabled"), "usage": None, "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def with_status(response: dict, status: str, **changes: Any) -> dict:
    return {**response, "status": status, **changes}


def run_body(body: dict) -> dict:
    """What the proxy sends upstream for a job: the client's request, in the
    foreground and streamed, so that its events arrive as they are made."""
    run = {key: value for key, value in body.items() if key not in ("background", "background_options")}
    run["stream"] = True
    return run


# -- entries ---------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    events: list[dict] = field(default_factory=list)
    head: dict | None = None  # the first entry's: {"response": queued, "stream": bool}
    upstream_id: str | None = None  # the upstream's id for the answer (what a continuation of the job names)
    cancelled: bool = False

    def encode(self) -> bytes:
        data: dict[str, Any] = {"e": self.events}
        if self.head is not None:
            data["h"] = self.head
        if self.upstream_id is not None:
            data["u"] = self.upstream_id
        if self.cancelled:
            data["c"] = True
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Entry | None:
        try:
            raw = json.loads(data)
        except ValueError:
            return None
        if not isinstance(raw, dict) or not isinstance(raw.get("e"), list):
            return None
        return cls(raw["e"], raw.get("h"), raw.get("u"), raw.get("c") is True)


@dataclass
class JobView:
    """A job as its log reads: what GET, cancel and a continuation need."""

    head: dict
    length: int  # entries in the log
    running: bool  # past queued
    outcome: str | None = None  # completed / failed / incomplete / cancelled
    final: dict | None = None  # the terminal event's response
    upstream_id: str | None = None

    @property
    def stored(self) -> bool:
        return self.head["response"].get("store") is not False

    @property
    def response(self) -> dict:
        """``GET /responses/{id}``: the response as it stands."""
        queued = self.head["response"]
        if self.final is not None:
            return self.final
        if self.outcome == "cancelled":
            return with_status(queued, "cancelled")
        return with_status(queued, "in_progress" if self.running else "queued")


def view(entries: dict[int, Entry], length: int) -> JobView | None:
    """The job read off its head and its last entries (``entries`` by index)."""
    first = entries.get(0)
    if first is None or first.head is None:
        return None
    job = JobView(first.head, length, running=length > 1)
    for index in sorted(entries):
        entry = entries[index]
        if entry.upstream_id:
            job.upstream_id = entry.upstream_id
        if job.outcome is not None:
            continue
        if entry.cancelled:
            job.outcome = "cancelled"
            continue
        for event in entry.events:
            if event.get("type") in TERMINAL:
                job.outcome, job.final = TERMINAL[event["type"]], event.get("response")
                break
    return job


def tail_indexes(length: int) -> list[int]:
    return sorted({0, *range(max(1, length - TAIL), length)})


def numbered(entries: Iterable[Entry], first: int = 0) -> Iterator[tuple[dict, bool]]:
    """Each served event with its sequence number (counted from ``first``),
    and whether the stream ends with it; a cancel mark ends it without one."""
    number = first
    for entry in entries:
        if entry.cancelled:
            yield {}, True
            return
        for event in entry.events:
            served = {**event, "sequence_number": number}
            number += 1
            if event.get("type") in TERMINAL:
                yield served, True
                return
            yield served, False


# -- relabelling an upstream's answer --------------------------------------------------------------------------


class Relabel:
    """The upstream's events for a foreground run, as a background response
    streams them: its own created/in_progress dropped (the job's head said
    created and queued; it says in progress once the run starts), every
    response object named by the job's id with ``background: true``, and an
    ``error`` event made the failure it is."""

    def __init__(self, queued: dict) -> None:
        self.queued = queued
        self.started = False
        self.upstream_id: str | None = None
        self.finished = False

    def _response(self, response: Any) -> Any:
        if not isinstance(response, dict):
            return response
        if self.upstream_id is None and isinstance(response.get("id"), str):
            self.upstream_id = response["id"]
        return {**response, "id": self.queued["id"], "background": True, "created_at": self.queued["created_at"]}

    def start(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        return [{"type": "response.in_progress", "response": with_status(self.queued, "in_progress")}]

    def events(self, upstream: Iterable[dict]) -> list[dict]:
        out: list[dict] = []
        for event in upstream:
            if self.finished or not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind in LIFECYCLE:
                self._response(event.get("response"))
                out += self.start()
                continue
            out += self.start()
            event = {key: value for key, value in event.items() if key != "sequence_number"}
            if kind == "error":
                out.append(self.failure(event.get("error") if isinstance(event.get("error"), dict) else event))
                continue
            if "response" in event:
                event["response"] = self._response(event["response"])
            if kind in TERMINAL:
                self.finished = True
            out.append(event)
        return out

    def answered(self, response: dict) -> list[dict]:
        """A whole answer (an upstream that answered JSON): its events, as a
        stream of it would have carried them, items whole."""
        events = self.start()
        output = response.get("output") if isinstance(response.get("output"), list) else []
        for index, item in enumerate(output):
            events.append({"type": "response.output_item.added", "output_index": index, "item": item})
            events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        status = response.get("status")
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(status, "response.completed")
        events.append({"type": kind, "response": self._response(response)})
        self.finished = True
        return events

    def failure(self, error: Any) -> dict:
        """The job's end when its run broke: ``failed``, with an error the client can read."""
        self.finished = True
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            error = {"code": "server_error", "message": "The upstream failed to answer."}
        error = {"code": error.get("code") or "server_error", "message": error["message"]}
        return {"type": "response.failed", "response": with_status(self.queued, "failed", error=error)}


def failed_event(queued: dict, message: str) -> dict:
    return {"type": "response.failed",
            "response": with_status(queued, "failed", error={"code": "server_error", "message": message})}


class SSEReader:
    """Server-sent events out of the chunks they arrive in (``data:`` lines joined)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        events = []
        while b"\n\n" in self._buffer:
            block, self._buffer = self._buffer.split(b"\n\n", 1)
            data = b"\n".join(line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:"))
            if not data or data == b"[DONE]":
                continue
            try:
                events.append(json.loads(data))
            except ValueError:
                continue
        return events


# -- the store ---------------------------------------------------------------------------------------------------


class Jobs:
    """Job logs and leases as writes for the store (a ``Remembers`` source)."""

    tables = {JOBS: 4_000_000, LEASES: 100_000}

    def __init__(self, config: Config) -> None:
        self.config = config
        self._outbox = Outbox()

    @staticmethod
    def key(tenant: Tenant, job_id: str) -> list[bytes]:
        """Where the job's log may be: under the store's secret, then older ones."""
        return tenant.record_keys(b"background-job", job_id)

    @staticmethod
    def ledger_key(tenant: Tenant) -> bytes:
        """Where the tenant's jobs are listed as they start: what its jobs at once are counted from."""
        return tenant.record_keys(b"background-ledger", "")[0]

    def started(self, tenant: Tenant, key: bytes) -> None:
        """List a job in its tenant's ledger (its key: a keyed digest, no content), for as long as it may run."""
        self._outbox.append(Write(JOBS, self.ledger_key(tenant), key, MAX_RUN_S, log="start"))

    def append(self, tenant: Tenant, key: bytes, entry: Entry, start: bool = False, stored: bool = True) -> int:
        """Queue one entry; its sealed size. A job sent with ``store: false``
        is kept only while it can run and be polled (``UNSTORED_TTL``), as the
        API keeps such a background response for polling only."""
        sealed = tenant.seal(entry.encode(), key)
        ttl = self.config.ttl if stored else min(self.config.ttl, UNSTORED_TTL)
        self._outbox.append(Write(JOBS, key, sealed, ttl, log="start" if start else "append"))
        return len(sealed)

    def lease(self, key: bytes, seconds: float, holder: bytes) -> None:
        """The job's process is alive for ``seconds`` more; ``holder`` names
        that process (``replica_id``), so that it knows its own jobs after a restart."""
        self._outbox.append(Write(LEASES, key, struct.pack("!d", time.time() + seconds) + holder, seconds * 2))

    def release(self, key: bytes) -> None:
        self._outbox.append(Write(LEASES, key, None))

    def drop(self, key: bytes) -> None:
        self._outbox.append(Write(JOBS, key, None, log="drop"))
        self.release(key)

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self._outbox.clear()


def replica_id(host: str, confdir: str, listen: str) -> bytes:
    """What names one proxy across its restarts: its machine, its confdir and
    where it listens (two proxies cannot listen on one address)."""
    return blake3(f"{host}\x00{confdir}\x00{listen}".encode()).digest(16)


def lease_alive(record: bytes | None, now: float, me: bytes = b"", mine: bool = False) -> bool:
    """Whether a lease holds: unexpired, and, if it names this proxy (``me``),
    for a job this process runs (``mine``): one its earlier life held died with it."""
    if record is None or len(record) < 8 or struct.unpack("!d", record[:8])[0] <= now:
        return False
    return mine or not me or record[8:] != me


def opened(tenant: Tenant, key: bytes, records: dict[bytes, bytes], indexes: Iterable[int]) -> dict[int, Entry]:
    """The log's entries among ``records`` that open for this tenant, by index."""
    found = {}
    for index in indexes:
        sealed = records.get(log_entry(key, index))
        plain = tenant.open(sealed, key) if sealed is not None else None
        entry = Entry.decode(plain) if plain is not None else None
        if entry is not None:
            found[index] = entry
    return found


def length_of(records: dict[bytes, bytes], key: bytes) -> int:
    return log_length(records.get(key))
