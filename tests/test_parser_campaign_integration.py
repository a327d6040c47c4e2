"""Bodies whose meaning depends on the JSON parser, through one real mitmdump.

Two hypothesis campaigns. The first grows real conversations with the emulator
and writes every request body oddly (``odd_json``: whitespace, escapes, number
spellings, key order, huge strings, deep nesting, numbers beyond 64 bits),
sometimes ambiguously (duplicate keys, lone surrogates, ``1e400``, ``NaN``, a
BOM). The second serves oddly written answers, JSON and SSE, from a loopback
upstream of its own. ``strict_json`` is the judge, at every request:

* the upstream got the client's exact bytes, or a rewrite of a body every
  parser reads the same way, whose context equals the client's input under
  the strict reading;
* a continuation builds only on a response whose request, answer and history
  every parser reads the same way (Python's float rounding cannot hide a
  difference: the strict reading admits only number literals that are exactly
  the shortest text of their double);
* the client got the upstream's own answer to its own body, never a refusal
  the addon caused.

``STATEFUL_EXAMPLES=2000 scripts/test tests/test_parser_campaign_integration.py -s``
runs a long campaign; the default is a short derandomized run for CI.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import strict_json
from driver import INSTRUCTIONS, TOOLS, expand_input, httpx, without_comparisons
from harness import Proxy, start_mitmdump
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from odd_json import ESCAPES, PLAIN, SPECIAL_TEXT, Nested, Pairs, Style, Verbatim, write
from stateful_responses.emulator import Emulator
from strict_json import NotStrictJSON, first_difference

EXAMPLES = int(os.environ.get("STATEFUL_EXAMPLES", "40"))
# The short default run (CI) draws the same examples every time; a campaign
# set with STATEFUL_EXAMPLES draws fresh ones.
DERANDOMIZE = "STATEFUL_EXAMPLES" not in os.environ
MODEL = "gpt-test"
_serial = itertools.count()  # a fresh credential per example: examples share no state in the addon
SEEN: Counter = Counter()  # what a campaign exercised, so it can never pass vacuously


def campaign_settings(**kwargs) -> settings:
    return settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
                    suppress_health_check=list(HealthCheck), **kwargs)


# -- how bodies are written --------------------------------------------------

texts = st.one_of(
    st.sampled_from(["hello", "and then?", SPECIAL_TEXT, 'call:get_weather({"city": "Zürich"})']),
    st.text(st.characters(exclude_categories=["Cs"]) | st.sampled_from(SPECIAL_TEXT), max_size=12),
)
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(2**64, 2**200)
           | st.floats(allow_nan=False, allow_infinity=False) | texts)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                      max_leaves=8)
# An extra field on an item: part of the item, compared like any other field.
extras = st.none() | values | st.builds(Nested, st.sampled_from([30, 300, 500]), scalars)
styles = st.builds(
    Style,
    spaces=st.sampled_from([("",), (" ",), ("\t",), ("\r\n",), ("", " ", "\t", "\n", "\r\n", " \r\n\t ")]),
    escapes=st.sampled_from(ESCAPES),
    spell_numbers=st.booleans(),
    key_order=st.sampled_from(["kept", "reversed", "shuffled"]),
    seed=st.integers(0, 2**32),
)


def user_item(data, turn: int) -> dict:
    """A user turn: easy or typed, sometimes huge, sometimes with an extra field.
    Drawn part by part so that a failing example prints short."""
    text = data.draw(texts, label=f"turn {turn}: text")
    text += "x" * data.draw(st.sampled_from([0, 0, 0, 0, 50_000, 1_000_000]), label=f"turn {turn}: x appended")
    typed = data.draw(st.booleans(), label=f"turn {turn}: typed message")
    item: dict = ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
                  if typed else {"role": "user", "content": text})
    extra = data.draw(extras, label=f"turn {turn}: extra field")
    if extra is not None:
        item["x_data"] = extra
    return item


def decoy(value: Any) -> Any:
    """A value other than ``value``, of the same kind where there is one."""
    if isinstance(value, bool) or value is None:
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return -value if value else 1.0  # adding to a big float could leave it equal
    if isinstance(value, str):
        return value + " (decoy)"
    if isinstance(value, list):
        return value[:1] if len(value) > 1 else [*value, *value] or ["decoy"]
    if isinstance(value, dict):
        return {**value, "decoy": True}
    if isinstance(value, Nested):
        return Nested(value.depth + 1, value.leaf)
    raise TypeError(type(value).__name__)


def twice(obj: dict, key: str, first: Any, last: Any) -> Pairs:
    """``obj`` written with ``key`` twice, in the place it had (or at the end)."""
    pairs = [(k, v) for k, v in obj.items() if k != key]
    at = list(obj).index(key) if key in obj else len(pairs)
    return Pairs((*pairs[:at], (key, first), (key, last), *pairs[at:]))


def replace(value: Any, path: tuple, change: Callable[[Any], Any]) -> Any:
    """``value`` with the node at ``path`` changed; everything else shared."""
    if not path:
        return change(value)
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replace(value[head], rest, change)}
    return [replace(v, rest, change) if i == head else v for i, v in enumerate(value)]


def paths(value: Any, want: type, path: tuple = ()) -> list[tuple]:
    """Paths to every ``want`` inside ``value``, in document order."""
    found = [path] if isinstance(value, want) else []
    if isinstance(value, dict):
        for k, v in value.items():
            found += paths(v, want, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += paths(v, want, (*path, i))
    return found


@dataclass(frozen=True)
class Plainly:
    """No ambiguity: only the style's spelling."""

    def write(self, body: dict, style: Style) -> bytes:
        return write(body, style)


@dataclass(frozen=True)
class DuplicateTopKey:
    """A top-level key twice, first value different from the last (a key the
    body lacks is written as null and a value)."""

    key: str
    decoy_first: bool

    ABSENT = {"store": False, "previous_response_id": "resp_decoy", "conversation": "conv_decoy"}

    def write(self, body: dict, style: Style) -> bytes:
        real = body.get(self.key)
        other = decoy(real) if self.key in body else self.ABSENT.get(self.key, "decoy")
        first, last = (other, real) if self.decoy_first else (real, other)
        return write(twice(body, self.key, first, last), style)


@dataclass(frozen=True)
class DuplicateInnerKey:
    """A key twice in an object inside the input (an item, a content part, an
    extra field at any depth), first value different from the last."""

    where: int
    which: int
    decoy_first: bool

    def write(self, body: dict, style: Style) -> bytes:
        objects = [("input", *p) for p in paths(body["input"], dict)]
        path = objects[self.where % len(objects)]

        def duplicate(obj: dict) -> Pairs:
            key = list(obj)[self.which % len(obj)] if obj else "decoy"
            real = obj.get(key)
            first, last = (decoy(real), real) if self.decoy_first else (real, decoy(real))
            return twice(obj, key, first, last)

        return write(replace(body, path, duplicate), style)


@dataclass(frozen=True)
class LoneSurrogate:
    """A lone surrogate at the end of a string: escaped, or encoded raw when
    the style writes characters raw. Not in ``instructions``: the emulator
    breaks down on it there (it hashes their UTF-8), which is not the addon's
    doing."""

    where: int
    surrogate: str

    def write(self, body: dict, style: Style) -> bytes:
        strings = [p for p in paths(body, str) if p != ("instructions",)]
        return write(replace(body, strings[self.where % len(strings)], lambda s: s + self.surrogate), style)


@dataclass(frozen=True)
class OddNumber:
    """A number literal parsers read differently, in an extra field of some object."""

    where: int
    literal: bytes

    def write(self, body: dict, style: Style) -> bytes:
        objects = paths(body, dict)
        return write(replace(body, objects[self.where % len(objects)],
                             lambda obj: {**obj, "x_number": Verbatim(self.literal)}), style)


@dataclass(frozen=True)
class ByteOrderMark:
    def write(self, body: dict, style: Style) -> bytes:
        return write(body, style, bom=True)


ambiguities = st.one_of(
    st.builds(DuplicateTopKey, st.sampled_from(["input", "input", "model", "stream", "store", "tools", "instructions",
                                                "previous_response_id", "conversation"]), st.booleans()),
    st.builds(DuplicateInnerKey, st.integers(0, 50), st.integers(0, 5), st.booleans()),
    st.builds(LoneSurrogate, st.integers(0, 50), st.sampled_from(["\ud800", "\udfff", "\udc00\ud800"])),
    st.builds(OddNumber, st.integers(0, 20), st.sampled_from([
        b"1e400", b"-1e400", b"1e-400", b"1.00000000000000000001", b"2.5e-324", b"9007199254740993.0",
        b"NaN", b"Infinity", b"-Infinity"])),
    st.just(ByteOrderMark()),
)
quirks = st.booleans().flatmap(lambda odd: ambiguities if odd else st.just(Plainly()))  # half the bodies plain


# -- reading answers as a client does ------------------------------------------


def sse_payloads(answer: httpx.Response) -> list[str]:
    """The data of each event (multi-line data joined, as the SSE standard says)."""
    events = answer.content.decode("utf-8", "surrogatepass").split("\n\n")
    return ["\n".join(line[6:] for line in e.split("\n") if line.startswith("data: ")) for e in events if "data: " in e]


def is_sse(answer: httpx.Response) -> bool:
    return answer.headers.get("content-type", "").startswith("text/event-stream")


def output_read_by_client(answer: httpx.Response) -> list:
    """The output items a Python client reads from a 200 answer (the standard
    library's reading: the last of duplicate keys wins)."""
    if answer.status_code != 200:
        return []
    if not is_sse(answer):
        return json.loads(answer.content).get("output") or []
    events = [json.loads(p) for p in sse_payloads(answer)]
    final = next((e["response"] for e in reversed(events) if "response" in e), {})
    return final.get("output") or [e["item"] for e in events if e.get("type") == "response.output_item.done"]


# What the addon learns from: the response object and, in an SSE stream, the
# event's type and items.
LEARNED_FIELDS = {"type", "response", "item", "output_index", "id", "status", "store", "output", "previous_response_id"}


def learned_fields_ambiguity(text: bytes | str) -> str | None:
    """Why parsers would read the parts of an answer object (JSON body or SSE
    event) that the addon learns from differently, or None. Other fields may
    be odd: the emulator echoes the request's ``tools`` and ``instructions``."""
    try:
        found = strict_json.members(text)
    except ValueError:
        return None  # not an object: nothing to learn from
    keys = [k for k, _ in found]
    for key, value in found:
        if key not in LEARNED_FIELDS:
            continue
        if keys.count(key) > 1:
            return f"{key!r} written twice"
        if key == "response":
            why = learned_fields_ambiguity(value)
            if why:
                return f"in response: {why}"
            continue
        try:
            strict_json.loads(value)
        except NotStrictJSON as e:
            return f"{key}: {e}"
    return None


def answer_ambiguity(answer: httpx.Response) -> str | None:
    for text in sse_payloads(answer) if is_sse(answer) else [answer.content]:
        why = learned_fields_ambiguity(text)
        if why:
            return why
    return None


def input_ambiguity(raw: bytes) -> str | None:
    """Why parsers would read the request's items differently, or None. The
    rest of the body may be ambiguous without changing what the upstream stores."""
    try:
        inputs = [value for key, value in strict_json.members(raw) if key == "input"]
    except ValueError as e:
        return f"not an object ({e})"
    if len(inputs) != 1:
        return f"{len(inputs)} input members"
    try:
        strict_json.loads(inputs[0])
    except NotStrictJSON as e:
        return f"input: {e}"
    return None


def shortened(raw: bytes) -> bytes:
    """A body for a failure message: long strings and deep nesting shortened."""
    raw = re.sub(rb'"([^"\\]{40})[^"\\]{20,}', lambda m: b'"' + m.group(1) + b"...", raw)
    return re.sub(rb"\[{8,}", lambda m: b"[*%d" % len(m.group()), re.sub(rb"\]{8,}", lambda m: b"]*%d" % len(m.group()), raw))


# -- the judge -----------------------------------------------------------------


@dataclass
class Judge:
    """The checks every request gets. Knows which responses are safe to
    continue from: those whose request items, answer and whole history every
    parser reads the same way."""

    proxy: Any
    clean: set[str] = field(default_factory=set)
    unsafe: dict[str, str] = field(default_factory=dict)  # response id: why it is not safe to continue from

    def check(self, raw: bytes, answer: httpx.Response, records: list[dict]) -> None:
        try:
            body, ambiguity = strict_json.loads(raw), None
        except NotStrictJSON as e:
            body, ambiguity = None, str(e)
        sha = hashlib.sha256(raw).hexdigest()

        def report(what: str) -> str:
            seen = [{k: r.get(k) for k in ("status_code", "previous_response_id", "input_items", "continued")}
                    | {"bytes": "the client's" if r["body_sha256"] == sha else "rewritten"} for r in records]
            decisions = [line for line in self.proxy.output().splitlines() if "stateful-responses:" in line][-2:]
            return (f"{what}\n  client body: {shortened(raw)!r}\n  strict reading: {ambiguity or 'unambiguous'}"
                    f"\n  upstream saw: {seen}\n  proxy said: {decisions}")

        assert records, report("NOTHING REACHED THE UPSTREAM")
        assert all("status_code" in r for r in records), report("THE UPSTREAM BROKE DOWN WITHOUT ANSWERING")
        *refused, final = records
        rewrites = [r for r in records if r["body_sha256"] != sha]
        final_rewritten = final["body_sha256"] != sha
        SEEN["requests"] += 1
        SEEN["ambiguous"] += ambiguity is not None
        SEEN["rewritten"] += bool(rewrites)
        SEEN["continued"] += final_rewritten and final.get("previous_response_id") is not None
        SEEN["refused rewrites retried"] += bool(refused)

        assert ambiguity is None or not rewrites, report("REWROTE A BODY PARSERS READ DIFFERENTLY")
        for r in rewrites:
            parent = r.get("previous_response_id")
            assert parent is None or parent in self.clean, report(
                f"CONTINUED FROM {parent}: {self.unsafe.get(parent, 'an id no answer gave as stored')}")
        # Before the client's own body: rewrites the upstream refused (4xx), or a continuation held and checked
        # (the usage proof holds the first continuation of an item kind; an answer that did not show the chain
        # read is replaced by the client's own body's), never more.
        assert all(r["body_sha256"] != sha and (400 <= r["status_code"] < 500 or r["status_code"] == 200)
                   for r in refused) and not (refused and final_rewritten), \
            report("THE UPSTREAM SAW MORE THAN A REFUSED OR CHECKED REWRITE AND THEN THE CLIENT'S OWN BODY")
        assert not (final_rewritten and 400 <= final["status_code"] < 500), report("A REFUSAL OF THE REWRITE REACHED THE CLIENT")
        assert answer.status_code == final["status_code"], report(f"THE CLIENT GOT {answer.status_code}, NOT THE UPSTREAM'S ANSWER")
        sent = final.get("answer") or final.get("sse", "").encode("utf-8", "surrogatepass")
        if sent:
            assert answer.content == sent, report("THE ANSWER'S BYTES CHANGED ON THE WAY")
        elif answer.status_code == 200:
            assert answer.json()["id"] == final["response_id"], report("THE CLIENT GOT ANOTHER RESPONSE")
        else:
            assert answer.json() == {"error": final["error"]}, report("THE CLIENT GOT ANOTHER ERROR")
        if final_rewritten and "context" in final:
            difference = first_difference(expand_input(body["input"]), final["context"])
            assert difference is None, report(f"UPSTREAM CONTEXT DIFFERS FROM THE CLIENT'S INPUT at {difference}")
        self.learn(raw, answer, final)

    def learn(self, raw: bytes, answer: httpx.Response, final: dict) -> None:
        """Mark the answered response safe to continue from, or say why not."""
        if answer.status_code != 200 or "response_id" not in final:
            return
        odd_answer = answer_ambiguity(answer)
        odd_input = input_ambiguity(raw)
        SEEN["ambiguous answers"] += odd_answer is not None
        parent = final.get("previous_response_id")
        if odd_answer:
            why = f"an answer parsers read differently ({odd_answer}): {shortened(answer.content)!r}"
        elif odd_input:
            why = f"a request whose items parsers read differently ({odd_input})"
        elif parent is not None and parent not in self.clean:
            why = f"continues {parent}, itself unsafe"
        elif not final.get("stored"):
            why = "not stored by the upstream"
        else:
            self.clean.add(final["response_id"])
            return
        for rid in final.get("ids", {final["response_id"]}):
            self.unsafe[rid] = why


def send(http: httpx.Client, proxy, key: str, raw: bytes) -> httpx.Response:
    return http.post(proxy.url + "/v1/responses", content=raw,
                     headers={"authorization": f"Bearer {key}", "content-type": "application/json"})


def tool_outputs(output: list, extra: Any) -> list:
    """The client's answers to the function calls in ``output``."""
    answers = []
    for call in output:
        if call.get("type") == "function_call":
            item = {"type": "function_call_output", "call_id": call.get("call_id"), "output": '{"temp_c": 21}'}
            if extra is not None:
                item["x_data"] = extra
            answers.append(item)
    return answers


def assert_no_internal_errors(proxy, since: int) -> None:
    """The addon passes a flow it fails on, but a failure is still a bug."""
    output = proxy.output()[since:]
    assert "internal error" not in output, f"THE ADDON HIT AN INTERNAL ERROR in this example:\n{output[-3000:]}"


# -- campaign 1: oddly written requests, the emulator as upstream ---------------


@contextlib.contextmanager
def proxied(upstream_url: str) -> Iterator[tuple[Proxy, httpx.Client]]:
    """mitmdump with the addon (debug lines on) in front of an upstream, and a
    client for it; the proxy is stopped whatever happens."""
    proxy = start_mitmdump(upstream_url, "--set", "stateful_debug=true")
    try:
        with httpx.Client(trust_env=False, timeout=60) as http:
            yield proxy, http
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def stack():
    with Emulator() as emulator, proxied(emulator.url) as (proxy, http):
        yield emulator, proxy, http


@pytest.mark.integration
def test_oddly_written_requests_keep_their_meaning_or_pass_untouched(stack):
    emulator, proxy, http = stack
    SEEN.clear()

    @campaign_settings()
    @given(data=st.data())
    def conversation(data):
        emulator.model.control({"reset": True})  # examples share nothing upstream
        key, judge, history = f"sk-odd-{next(_serial)}", Judge(proxy), []
        log_position = len(proxy.output())
        for turn in range(data.draw(st.integers(2, 5), label="turns")):
            history = [*history, user_item(data, turn)]
            body = {"model": MODEL, "instructions": INSTRUCTIONS, "tools": TOOLS, "input": history,
                    "stream": data.draw(st.booleans(), label=f"turn {turn}: stream")}
            store = data.draw(st.sampled_from([None, True, False]), label=f"turn {turn}: store")
            if store is not None:
                body["store"] = store
            quirk = data.draw(quirks, label=f"turn {turn}: quirk")
            raw = quirk.write(body, data.draw(styles, label=f"turn {turn}: style"))
            before = len(emulator.model.snapshot_log())
            answer = send(http, proxy, key, raw)
            judge.check(raw, answer, without_comparisons(emulator.model.snapshot_log()[before:]))
            output = output_read_by_client(answer)
            history = [*history, *output, *tool_outputs(output, data.draw(extras, label=f"turn {turn}: tool extra"))]
        assert_no_internal_errors(proxy, log_position)

    conversation()
    print(f"\nodd requests: {EXAMPLES} examples, {dict(SEEN)}")
    assert SEEN["ambiguous"] > 0 and SEEN["continued"] > 0, dict(SEEN)


# -- campaign 2: oddly written answers, from an upstream of the test's own ------


@dataclass(frozen=True)
class AnswerWriting:
    """How the next answer is written. ``quirk``: clean (only the style's
    spelling) | id | status | store | output | item (a key twice, first
    different from last: the truth and a decoy) | surrogate (a lone one in the
    output text). For ``status`` the truth is "incomplete", for ``store`` it
    is false: not stored either way, and the decoy says otherwise.
    ``empty_terminal_output``: an SSE answer whose final event leaves
    ``output`` empty, so the items come from ``output_item.done``."""

    quirk: str
    decoy_first: bool
    style: Style
    empty_terminal_output: bool


answer_writings = st.builds(
    AnswerWriting,
    st.sampled_from(["clean", "clean", "id", "status", "store", "output", "item", "surrogate"]),
    st.booleans(), styles, st.booleans(),
)


class OddAnswerUpstream:
    """A loopback Responses upstream whose answers are written as the test
    says. It keeps what it really did (the truth: which id, whether stored,
    which output) and honours ``previous_response_id`` per credential; an
    unknown id gets the API's 400. Its log has the emulator's fields, plus the
    exact ``answer`` bytes and every response ``ids`` an answer names."""

    def __init__(self) -> None:
        self.writing = AnswerWriting("clean", False, PLAIN, False)
        self.log: list[dict] = []
        self._stored: dict[tuple[str, str], list] = {}
        self._retrieved: dict[tuple[str, str], dict] = {}  # what GET /responses/{id} answers
        self._serial = itertools.count()
        self._lock = threading.Lock()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                with upstream._lock:
                    status, content_type, answer = upstream.answer(raw, self.headers.get("authorization", ""))
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def do_GET(self) -> None:  # retrieve, as the API answers it: what proves it stores
                response_id = self.path.rstrip("/").rsplit("/", 1)[-1]
                with upstream._lock:
                    found = upstream._retrieved.get((self.headers.get("authorization", ""), response_id))
                answer = json.dumps(found if found else {"error": {"message": "not found"}}).encode()
                self.send_response(200 if found else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OddAnswerUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def answer(self, raw: bytes, credential: str) -> tuple[int, str, bytes]:
        record: dict = {"body_sha256": hashlib.sha256(raw).hexdigest(), "previous_response_id": None}
        self.log.append(record)
        try:
            body = json.loads(raw)
            items, previous = body["input"], body.get("previous_response_id")
        except (ValueError, KeyError, TypeError, AttributeError):
            return self._error(record, "We could not parse the JSON body of your request.")
        if not isinstance(items, list):
            return self._error(record, "Invalid type for 'input'.")
        record["previous_response_id"] = previous
        chain = self._stored.get((credential, previous), []) if previous is not None else []
        if previous is not None and (credential, previous) not in self._stored:
            return self._error(record, f"Previous response with id '{previous}' not found.")
        w = self.writing
        rid = f"resp_{next(self._serial)}"
        status = "incomplete" if w.quirk == "status" else "completed"
        store = body.get("store", True) is not False and w.quirk != "store"  # echoed as the API does
        stored = store and status == "completed"
        context = chain + items
        output = [self._output(context, bool(body.get("tools")), w.quirk == "surrogate")]
        if stored:
            self._stored[(credential, rid)] = context + output
        truth = {"id": rid, "object": "response", "status": status, "model": body.get("model"), "output": output,
                 "previous_response_id": previous, "store": store}
        if stored:
            self._retrieved[(credential, rid)] = truth
        record.update(status_code=200, context=context, response_id=rid, stored=stored, ids={rid, rid + "_decoy"})
        if body.get("stream"):
            record["answer"] = self._events(truth, w)
            return 200, "text/event-stream", record["answer"]
        record["answer"] = write(self._written(truth, w), w.style)
        return 200, "application/json", record["answer"]

    def _error(self, record: dict, message: str) -> tuple[int, str, bytes]:
        record.update(status_code=400, error={"message": message, "type": "invalid_request_error"})
        record["answer"] = json.dumps({"error": record["error"]}).encode()
        return 400, "application/json", record["answer"]

    @staticmethod
    def _output(context: list, tools: bool, surrogate: bool) -> dict:
        last = context[-1] if context and isinstance(context[-1], dict) else {}
        n = len(context)
        if tools and last.get("role") == "user" and "call:" in str(last.get("content")):
            return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "get_weather",
                    "arguments": '{"city": "Paris"}', "status": "completed"}
        text = f"I saw {n} items." + ("\ud800" if surrogate else "")
        return {"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _decoy_item(item: dict) -> dict:
        if item["type"] == "function_call":
            return {**item, "arguments": '{"city": "Decoy"}'}
        return {**item, "content": [{**item["content"][0], "text": item["content"][0]["text"] + " (decoy)"}]}

    def _written_item(self, item: dict, w: AnswerWriting) -> Any:
        if w.quirk != "item":
            return item
        key = "arguments" if item["type"] == "function_call" else "content"
        real, other = item[key], self._decoy_item(item)[key]
        return twice(item, key, *((other, real) if w.decoy_first else (real, other)))

    def _written(self, truth: dict, w: AnswerWriting, output: list | None = None) -> Any:
        response = {**truth, "output": [self._written_item(i, w) for i in (truth["output"] if output is None else output)]}
        decoys = {"id": truth["id"] + "_decoy", "status": "completed", "store": True,
                  "output": [self._decoy_item(i) for i in truth["output"]]}
        if w.quirk not in decoys:
            return response
        real, other = response[w.quirk], decoys[w.quirk]
        return twice(response, w.quirk, *((other, real) if w.decoy_first else (real, other)))

    def _events(self, truth: dict, w: AnswerWriting) -> bytes:
        shell = {**truth, "status": "in_progress", "output": []}
        events = [{"type": "response.created", "response": shell}]
        events += [{"type": "response.output_item.done", "output_index": i, "item": self._written_item(item, w)}
                   for i, item in enumerate(truth["output"])]
        terminal = {"type": f"response.{truth['status']}",
                    "response": self._written(truth, w, [] if w.empty_terminal_output else None)}
        out = b""
        for n, event in enumerate([*events, terminal]):
            text = write({**event, "sequence_number": n}, w.style).decode("utf-8", "surrogatepass")
            data = "".join(f"data: {line}\n" for line in re.split(r"\r\n|\r|\n", text))
            out += f"event: {event['type']}\n{data}\n".encode("utf-8", "surrogatepass")
        return out


@pytest.fixture(scope="module")
def odd_stack():
    with OddAnswerUpstream() as upstream, proxied(upstream.url) as (proxy, http):
        yield upstream, proxy, http


@pytest.mark.integration
def test_oddly_written_answers_never_teach_what_the_client_reads_differently(odd_stack):
    upstream, proxy, http = odd_stack
    SEEN.clear()

    @campaign_settings()
    @given(data=st.data())
    def conversation(data):
        key, judge, history = f"sk-answers-{next(_serial)}", Judge(proxy), []
        log_position = len(proxy.output())
        for turn in range(data.draw(st.integers(3, 5), label="turns")):
            history = [*history, {"role": "user", "content": data.draw(texts, label=f"turn {turn}: user text")}]
            body = {"model": MODEL, "tools": TOOLS, "input": history,
                    "stream": data.draw(st.booleans(), label=f"turn {turn}: stream")}
            upstream.writing = data.draw(answer_writings, label=f"turn {turn}: answer")
            raw = json.dumps(body).encode()
            before = len(upstream.log)
            answer = send(http, proxy, key, raw)
            judge.check(raw, answer, upstream.log[before:])
            output = output_read_by_client(answer)
            history = [*history, *output, *tool_outputs(output, None)]
        assert_no_internal_errors(proxy, log_position)

    conversation()
    print(f"\nodd answers: {EXAMPLES} examples, {dict(SEEN)}")
    assert SEEN["ambiguous answers"] > 0 and SEEN["continued"] > 0, dict(SEEN)


# -- the judge and the writer themselves ---------------------------------------


@pytest.mark.parametrize(("text", "why"), [
    (b'{"input": [], "input": [{"role": "user", "content": "hi"}]}', "duplicate key 'input' at $.input"),
    (b'{"a": {"b": [{"c": 1, "\\u0063": 2}]}}', "duplicate key 'c' at $.a.b[0].c"),
    (b'["\\ud800"]', "lone surrogate"),
    (b'["\\udc00\\ud800"]', "lone surrogate"),
    (b'["\xed\xa0\x80"]', "not UTF-8"),
    (b'\xef\xbb\xbf{}', "byte order mark"),
    (b"[NaN]", "NaN or Infinity"),
    (b"[1e400]", "not exact as a double"),
    (b"[1e-400]", "not exact as a double"),
    (b"[1.00000000000000000001]", "not exact as a double"),
    (b"[9007199254740993.0]", "not exact as a double"),
    (b"[1, ]", "expected a value"),
    (b'["a\x01"]', "control character"),
])
def test_strict_reading_refuses_what_parsers_read_differently(text, why):
    with pytest.raises(NotStrictJSON, match=re.escape(why)):
        strict_json.loads(text)


def test_strict_reading_keeps_exact_values_and_tells_zeros_and_types_apart():
    value = strict_json.loads(b'[-0, -0.0, 0.1, 1e23, 5e-324, 18446744073709551617, "\\ud83d\\ude00", 1, 1.0, true]')
    assert value == [0, -0.0, 0.1, 1e23, 5e-324, 2**64 + 1, "😀", 1, 1.0, True]
    assert first_difference(value[1], 0.0) == "$: -0.0 vs 0.0"
    assert first_difference(value[7:], [1.0, 1, 1]) == "$[2]: bool vs int"


@settings(max_examples=300, derandomize=True)
@given(values, styles)
def test_odd_writing_keeps_the_meaning_under_both_readings(value, style):
    text = write(value, style)
    assert first_difference(strict_json.loads(text), value) is None
    assert first_difference(json.loads(text), value) is None


@settings(max_examples=200, derandomize=True)
@given(ambiguities, styles, st.lists(st.builds(dict, role=st.just("user"), content=texts), min_size=1, max_size=3))
def test_every_ambiguity_the_campaign_writes_is_read_by_python_and_refused_by_the_judge(quirk, style, items):
    raw = quirk.write({"model": MODEL, "tools": TOOLS, "input": items}, style)
    json.loads(raw)  # the upstream (Python) reads it: the campaign tests ambiguity, not garbage
    with pytest.raises(NotStrictJSON):
        strict_json.loads(raw)


def test_the_judge_reads_the_parts_that_matter_on_their_own():
    odd_elsewhere = b'\xef\xbb\xbf{"tools": ["\xed\xa0\x80", NaN], "input": [{"role": "user", "content": "hi"}]}'
    assert input_ambiguity(odd_elsewhere) is None
    assert input_ambiguity(b'{"input": [], "\\u0069nput": []}') == "2 input members"
    assert "duplicate key 'a'" in input_ambiguity(b'{"input": [{"a": 1, "a": 2}]}')
    assert learned_fields_ambiguity(b'{"id": "resp_1", "tools": [NaN], "id": "resp_2"}') == "'id' written twice"
    assert learned_fields_ambiguity(b'{"id": "resp_1", "tools": [NaN], "instructions": "\\ud800"}') is None
    event = '{"type": "response.completed", "response": {"status": "completed", "status": "failed"}}'
    assert learned_fields_ambiguity(event) == "in response: 'status' written twice"
