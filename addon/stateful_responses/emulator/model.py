"""The API's semantics, without HTTP: stored responses, continuation, the
deterministic model, and fault injection.

This is an oracle for the addon, so it follows the real API (FACTS.md), not
the addon: responses are stored per credential; ``previous_response_id`` makes
the context the stored chain (every input and output before) plus this input;
``instructions`` and ``tools`` are not inherited; unknown or unstored parents
get the API's own error body.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_PATTERN = re.compile(r"call:([A-Za-z_][A-Za-z0-9_]*)\((\{.*?\})\)")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def context_digest(items: list) -> str:
    return hashlib.sha256(canonical(items)).hexdigest()[:16]


def _text_of(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class Faults:
    """Run-time fault injection (set through the control endpoint)."""

    stateless: str | None = None  # "reject" (llama.cpp) | "ignore" (Ollama)
    echo_store: bool = True  # False: answers omit the ``store`` field
    echo_previous: bool = True  # False: answers omit the ``previous_response_id`` field
    refuse_store: bool = False  # a zero-data-retention organization
    forget_probability: float = 0.0
    slow_ms: int = 0
    gzip: bool = False
    next: list[dict] = field(default_factory=list)  # one-shot faults, FIFO

    def take(self, continued: bool) -> dict | None:
        for i, fault in enumerate(self.next):
            when = fault.get("when", "any")
            if when == "any" or (when == "continued") == continued:
                return self.next.pop(i)
        return None


@dataclass
class Stored:
    response: dict
    context: list  # the whole chain: every input and output up to and including this response
    stored: bool


class ResponsesModel:
    def __init__(self, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.faults = Faults()
        self._stored: dict[tuple[str, str], Stored] = {}
        self.log: list[dict] = []

    # -- control -------------------------------------------------------------

    def control(self, command: dict) -> dict:
        with self._lock:
            for key in ("stateless", "echo_store", "echo_previous", "refuse_store", "forget_probability", "slow_ms", "gzip"):
                if key in command:
                    setattr(self.faults, key, command[key])
            if "fail_next" in command:
                self.faults.next.extend(command["fail_next"])
            for rid in command.get("forget", []):
                for k in [k for k in self._stored if k[1] == rid]:
                    del self._stored[k]
            if command.get("forget_all"):
                self._stored.clear()
            if command.get("reset"):
                self._stored.clear()
                self.log.clear()
                self.faults = Faults()
            return {"stored": len(self._stored), "log": len(self.log)}

    def record_stream(self, response_id: str, sent: bytes) -> None:
        """Keep the exact event-stream bytes sent for a response (before any
        content-encoding), so tests can compare them with what a client got."""
        with self._lock:
            for record in reversed(self.log):
                if record.get("response_id") == response_id:
                    record["sse"] = sent.decode()
                    return

    def snapshot_log(self) -> list[dict]:
        with self._lock:
            return list(self.log)

    # -- one request ---------------------------------------------------------

    def handle(self, credential: str, body: Any, body_bytes: int, raw_sha256: str = "") -> tuple[dict, dict | None]:
        """Validate, resolve context, answer. Returns (response, one-shot fault).

        Raises APIError with the API's status and body for refused requests.
        """
        record: dict[str, Any] = {"body_bytes": body_bytes, "body_sha256": raw_sha256, "credential": hashlib.sha256(credential.encode()).hexdigest()[:8]}
        with self._lock:
            self.log.append(record)
            try:
                response, fault = self._handle(credential, body, record)
            except APIError as e:
                record["error"] = e.body["error"]
                record["status_code"] = e.status
                raise
            record["status_code"] = 200
            return response, fault

    def _handle(self, credential: str, body: Any, record: dict) -> tuple[dict, dict | None]:
        if not credential:
            raise APIError(401, "You didn't provide an API key.", "invalid_request_error")
        if not isinstance(body, dict):
            raise APIError(400, "We could not parse the JSON body of your request.")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
        raw_input = body.get("input", [])
        if isinstance(raw_input, str):
            items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw_input}]}]
        elif isinstance(raw_input, list) and all(isinstance(i, dict) for i in raw_input):
            items = raw_input
        else:
            raise APIError(400, "Invalid type for 'input'.", param="input", code="invalid_type")
        previous = body.get("previous_response_id")
        store = body.get("store", True)
        f = self.faults
        record.update(input_items=len(items), previous_response_id=previous, stream=bool(body.get("stream")),
                      store=store, instructions=body.get("instructions"), model=model)

        if f.refuse_store and body.get("store") is True:
            raise APIError(400, "Store must be false for this organization due to Zero Data Retention.", param="store")
        chain: list = []
        if previous is not None:
            if f.stateless == "reject":
                raise APIError(400, "This server does not support 'previous_response_id'.")
            if f.stateless != "ignore":
                chain = self._resolve(credential, previous)
        fault = f.take(continued=previous is not None and f.stateless != "ignore")
        record["fault"] = fault.get("kind") if fault else None
        if fault and fault.get("kind") == "reject":
            raise APIError(fault.get("status", 400), fault.get("message", "Invalid `previous_response_id`."),
                           code=fault.get("code", "invalid_request_error"))
        if fault and fault.get("kind") == "status":
            raise APIError(fault.get("status", 500), "The server had an error while processing your request.", "server_error")

        context = chain + items
        record["continued"] = bool(chain)
        record["context"] = context
        record["context_digest"] = context_digest(context)
        output = self._generate(body, context)
        status = "completed"
        if fault and fault.get("kind") in ("failed", "incomplete"):
            status = fault["kind"]
        response = self._response_object(body, model, output, status, previous, store)
        keep = store is not False and f.stateless is None and not f.refuse_store and status == "completed"
        if keep:
            self._stored[(credential, response["id"])] = Stored(response, context + output, True)
        record["response_id"] = response["id"]
        record["stored"] = keep
        record["output"] = output
        return response, fault

    def _resolve(self, credential: str, previous: Any) -> list:
        stored = self._stored.get((credential, previous)) if isinstance(previous, str) else None
        if stored is not None and self.faults.forget_probability and self._rng.random() < self.faults.forget_probability:
            del self._stored[(credential, previous)]
            stored = None
        if stored is None:
            raise APIError(400, f"Previous response with id '{previous}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return list(stored.context)

    def _generate(self, body: dict, context: list) -> list:
        """The deterministic model. It calls a tool when the newest user
        message says ``call:NAME({json})`` and NAME is an offered function;
        otherwise it answers with a digest of exactly the context it saw."""
        last = context[-1] if context else {}
        output: list = []
        if isinstance(body.get("reasoning"), dict):
            reasoning = {"type": "reasoning", "id": _new_id("rs"), "summary": []}
            if "reasoning.encrypted_content" in (body.get("include") or []):
                reasoning["encrypted_content"] = "enc_" + context_digest(context)
            output.append(reasoning)
        tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"}
        match = CALL_PATTERN.search(_text_of(last)) if last.get("role") == "user" else None
        if match and match.group(1) in tools:
            try:
                args = json.loads(match.group(2))
            except ValueError:
                args = {}
            output.append({
                "type": "function_call", "id": _new_id("fc"), "call_id": _new_id("call"),
                "name": match.group(1), "arguments": json.dumps(args), "status": "completed",
            })
            return output
        text = f"I saw {len(context)} items; context digest {context_digest(context)}."
        if body.get("instructions"):
            text += f" Instructions digest {hashlib.sha256(str(body['instructions']).encode()).hexdigest()[:8]}."
        output.append({
            "type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        })
        return output

    def _response_object(self, body: dict, model: str, output: list, status: str,
                         previous: Any, store: Any) -> dict:
        tokens_in = sum(len(canonical(i)) for i in output) // 4
        response = {
            "id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": output if status != "failed" else [],
            "parallel_tool_calls": True, "previous_response_id": previous,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": body.get("tools") or [], "top_p": 1.0, "truncation": "disabled",
            "usage": {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": tokens_in + 8},
            "user": None, "metadata": body.get("metadata") or {},
        }
        if status == "failed":
            response["error"] = {"code": "server_error", "message": "The model failed to answer."}
        if not self.faults.echo_previous:
            del response["previous_response_id"]
        if self.faults.echo_store:
            response["store"] = store is not False and self.faults.stateless is None and not self.faults.refuse_store
        return response


def sse_events(response: dict, terminal_event: str | None = None) -> list[dict]:
    """The event sequence the API streams for one response. ``terminal_event``
    overrides the last event's name, as servers do that end every stream with
    ``response.completed`` whatever the status (vLLM)."""
    shell = {**response, "status": "in_progress", "output": [], "usage": None}
    events: list[dict] = [
        {"type": "response.created", "response": shell},
        {"type": "response.in_progress", "response": shell},
    ]
    for index, item in enumerate(response["output"]):
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        if item["type"] == "function_call":
            added["arguments"] = ""
        if item["type"] == "reasoning" and "encrypted_content" in item:
            added["encrypted_content"] = item["encrypted_content"][:4]  # incomplete in .added
        events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        if item["type"] == "message":
            part = item["content"][0]
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": {**part, "text": ""}})
            words = re.findall(r"\S+\s*", part["text"])
            for w in words:
                events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "delta": w, "logprobs": []})
            events.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": part["text"], "logprobs": []})
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": part})
        elif item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": item["arguments"]})
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    terminal = terminal_event or {"completed": "response.completed", "failed": "response.failed",
                                  "incomplete": "response.incomplete"}[response["status"]]
    events.append({"type": terminal, "response": response})
    for n, event in enumerate(events):
        event["sequence_number"] = n
    return events
