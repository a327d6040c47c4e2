"""Drive a multi-turn, tool-using conversation with the real openai SDK and
check, request by request, what the upstream effectively saw."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import openai

try:  # openai-python 3.x speaks through httpx2, 1.x and 2.x through httpx
    import httpx2 as httpx
except ImportError:
    import httpx

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
INSTRUCTIONS = "You are a terse assistant."


def user_turns(n: int, tag: str = "") -> list[str]:
    """n user turns; every third one asks for a tool call."""
    turns = []
    for i in range(n):
        if i % 3 == 1:
            turns.append(f'{tag}turn {i}: call:get_weather({{"city": "City{i}"}})')
        else:
            turns.append(f"{tag}turn {i}: tell me something about the number {i}.")
    return turns


def drop_nulls(value: Any) -> Any:
    """The API treats a null field as absent."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def expand_input(value: Any) -> list:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    return value


@dataclass
class Sent:
    body: dict
    size: int


@dataclass
class Conversation:
    """One conversation through ``base_url``; records every request body the
    client sent (before the proxy)."""

    base_url: str
    api_key: str = "sk-test-key"
    stream: bool = False
    as_dicts: bool = False  # pass output back as model_dump() dicts instead of SDK objects
    model: str = "gpt-test"
    options: dict = field(default_factory=dict)  # more create parameters (store=False, say)
    max_retries: int = 0
    history: list = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)

    def __post_init__(self) -> None:
        def hook(request: httpx.Request) -> None:
            if request.url.path.endswith("/responses"):
                body = request.read()
                self.sent.append(Sent(json.loads(body), len(body)))

        self.client = openai.OpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key,
            max_retries=self.max_retries,
            http_client=httpx.Client(event_hooks={"request": [hook]}, trust_env=False, timeout=30),
        )

    def close(self) -> None:
        self.client.close()

    def _create(self):
        return self._send(dict(model=self.model, input=self.history, tools=TOOLS, instructions=INSTRUCTIONS,
                               **self.options))

    def _send(self, kwargs: dict):
        """One request, JSON or streamed: the final response either way."""
        if not self.stream:
            return self.client.responses.create(**kwargs)
        final = None
        with self.client.responses.create(stream=True, **kwargs) as events:
            for event in events:
                if event.type in ("response.completed", "response.failed", "response.incomplete"):
                    final = event.response
        assert final is not None, "stream ended without a terminal event"
        return final

    def turn(self, text: str) -> int:
        """One user turn, including the tool loop. Returns requests made."""
        self.history.append({"role": "user", "content": text})
        requests = 0
        while True:
            response = self._create()
            requests += 1
            output = [o.model_dump() if self.as_dicts else o for o in response.output]
            self.history.extend(output)
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                return requests
            for call in calls:
                args = json.loads(call.arguments)
                self.history.append(
                    {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"city": args.get("city"), "temp_c": 21})}
                )


@dataclass
class ChainedConversation(Conversation):
    """A client that keeps state with ``previous_response_id``: each request
    carries only the items after the last answer. ``meant[k]`` is the whole
    context request k means (every input and output before it, plus its own
    input), as the API defines it."""

    previous: str | None = None
    meant: list[list] = field(default_factory=list)
    _sent_upto: int = 0

    def _create(self):
        new = self.history[self._sent_upto:]
        self.meant.append([_as_dict(i) for i in self.history])
        kwargs = dict(model=self.model, input=new, tools=TOOLS, instructions=INSTRUCTIONS)
        if self.previous is not None:
            kwargs["previous_response_id"] = self.previous
        response = self._send(kwargs)
        self.previous = response.id
        self._sent_upto = len(self.history) + len(response.output)
        return response


def _as_dict(item: Any) -> Any:
    return item.model_dump(exclude_unset=True) if hasattr(item, "model_dump") else item


class ToolAgent:
    """One tool-using conversation of the openai SDK, as a gateway's tests drive it: ``chained`` sends only what
    is new with ``previous_response_id``, else the whole history. Each request's whole context is kept by
    ``_meant``; ``_kept`` says how the answer's items go back into the history (a gateway may want them
    without ids)."""

    model = "gpt-test"

    def __init__(self, client: openai.OpenAI, *, chained: bool, stream: bool = False, **options) -> None:
        self.client = client
        self.chained, self.stream, self.options = chained, stream, options
        self.history: list[dict] = []
        self.sent_upto = 0
        self.previous: str | None = None
        self.meant: list = []

    def _send(self, **body):
        if not self.stream:
            return self.client.responses.create(**body)
        with self.client.responses.create(stream=True, **body) as events:
            final = [event.response for event in events if event.type == "response.completed"]
        assert final, "the stream ended without response.completed"
        return final[-1]

    def _meant(self, context: list[dict], output: list[dict]) -> None:
        self.meant.append(context)

    def _kept(self, output: list[dict]) -> list[dict]:
        return output

    def _request(self) -> list[dict]:
        body = dict(model=self.model, tools=TOOLS, instructions=INSTRUCTIONS, **self.options)
        body["input"] = self.history[self.sent_upto:] if self.chained else self.history
        if self.chained and self.previous is not None:
            body["previous_response_id"] = self.previous
        response = self._send(**body)
        output = [item.model_dump(exclude_unset=True) for item in response.output]
        self._meant(list(self.history), output)
        self.previous = response.id
        self.history.extend(self._kept(output))
        self.sent_upto = len(self.history)
        return output

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        while calls := [item for item in self._request() if item["type"] == "function_call"]:
            self.history += [{"type": "function_call_output", "call_id": call["call_id"],
                              "output": json.dumps({"city": json.loads(call["arguments"])["city"], "temp_c": 21})}
                             for call in calls]

    def converse(self, turns: list[str]) -> ToolAgent:
        for text in turns:
            self.turn(text)
        return self

    def close(self) -> None:
        self.client.close()


def assert_chain_context_preserved(conv: ChainedConversation, log: list[dict]) -> None:
    """For every request the client's SDK saw answered: the upstream's effective
    context == the context its previous_response_id chain means."""
    served = [r for r in log if r.get("status_code") == 200]
    assert len(served) == len(conv.meant), (len(served), len(conv.meant))
    for n, (meant, seen) in enumerate(zip(conv.meant, served, strict=True)):
        assert drop_nulls(seen["context"]) == drop_nulls(expand_input(meant)), \
            f"request {n}: the upstream's context differs from the chain the client named"


_BOOKKEEPING = {"id", "status", "annotations", "logprobs"}


def meaning(item: Any) -> Any:
    """An item as the model sees it, written here independently of the addon:
    bookkeeping fields and nulls dropped, an easy message as its typed form,
    function-call arguments as parsed JSON. Used only for clients that
    re-shape items (langchain); the openai SDK tests compare exactly."""
    if isinstance(item, list):
        return [meaning(i) for i in item]
    if not isinstance(item, dict):
        return item
    out = {k: meaning(v) for k, v in item.items() if v is not None and k not in _BOOKKEEPING}
    if "role" in out and out.get("type", "message") == "message":
        out["type"] = "message"
        if isinstance(out.get("content"), str):
            kind = "output_text" if out["role"] == "assistant" else "input_text"
            out["content"] = [{"type": kind, "text": out["content"]}]
    if out.get("type") == "function_call" and isinstance(out.get("arguments"), str):
        out["arguments"] = json.loads(out["arguments"])
    return out


def _compared(continued: dict, record: dict) -> bool:
    """Whether ``record`` is the proxy's comparison of the answered HTTP continuation before it."""
    return (continued.get("continued") is True and not record.get("continued")
            and continued.get("status_code", 200) == 200 and not continued.get("fault") and not record.get("fault")
            and continued.get("transport", "http") == "http" == record.get("transport", "http")
            and meaning(record["context"]) == meaning(continued["context"]))


def without_comparisons(log: list[dict]) -> list[dict]:
    """The upstream's log less the proxy's comparisons: a continuation whose
    conversation holds an item kind the upstream has not shown it keeps is sent
    whole too, right after, to compare their input tokens (the same context,
    not continued)."""
    kept: list[dict] = []
    last: dict | None = None  # the last record that made a context
    for record in log:
        if "context" in record and last is not None and _compared(last, record):
            continue
        kept.append(record)
        if "context" in record:
            last = record
    return kept


def client_turns(log: list[dict]) -> list[dict]:
    """The upstream's records of the client's turns: each request that made a
    context, less the proxy's comparisons."""
    return [r for r in without_comparisons(log) if "context" in r]


def assert_context_preserved(sent: list[Sent], log: list[dict], reshaped: bool = False) -> None:
    """For every request: the upstream's effective context == the client's input
    (exactly, nulls aside; or in meaning, for clients that re-shape items)."""
    same = meaning if reshaped else drop_nulls
    upstream = client_turns(log)
    assert len(upstream) == len(sent), (len(upstream), len(sent))
    for n, (client, seen) in enumerate(zip(sent, upstream, strict=True)):
        expected = same(expand_input(client.body["input"]))
        assert same(seen["context"]) == expected, f"request {n}: upstream context differs from the client's input"


def recording_clients(sent: list[Sent]):
    """(sync, async) HTTP clients for an SDK that record every request body."""

    def record(request) -> None:
        if request.url.path.endswith("/responses"):
            body = request.read()
            sent.append(Sent(json.loads(body), len(body)))

    async def arecord(request) -> None:
        record(request)

    return (httpx.Client(event_hooks={"request": [record]}, trust_env=False, timeout=30),
            httpx.AsyncClient(event_hooks={"request": [arecord]}, trust_env=False, timeout=30))


def weather_agent(agents: Any, proxy_url: str, http: Any) -> tuple[Any, openai.AsyncOpenAI]:
    """An openai-agents Agent with one function tool, and the openai client it
    talks to the proxy through (over ``http``); tracing is off, as it would
    export to the network. ``agents`` is the imported package."""
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"{city}: 21C"

    client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="sk-a", http_client=http, max_retries=0)
    agent = agents.Agent(name="assistant", instructions="Be terse.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="gpt-test", openai_client=client))
    return agent, client


async def tenant_of(storage: Any, key: str) -> Any:
    """The tenant a client sending ``Authorization: Bearer key`` is in, in an
    open store, derived as the proxy derives it."""
    from stateful_responses.request_reader import Request
    from stateful_responses.store_emulation.turns import Tenant
    from stateful_responses.tenancy import credential_material

    credential = credential_material(Request("POST", "http://x/v1/responses",
                                             {"authorization": f"Bearer {key}"}, b""))
    return Tenant.of((await storage.keyring())[0], credential)


def langchain_conversation(lc: Any, proxy_url: str, http: Any, texts: list[str], *, stream: bool = False,
                           **options: Any) -> None:
    """A langchain-openai ChatOpenAI (Responses API, one bound tool, ``options``
    such as ``use_previous_response_id``) through the proxy over ``http``: one
    user message per text, and the tool loop after each until the model
    answers without a call; streamed answers are summed chunk by chunk.
    ``lc`` is the imported langchain_openai package."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"{city}: 21C"

    llm = lc.ChatOpenAI(model="gpt-test", base_url=proxy_url + "/v1", api_key="sk-a", use_responses_api=True,
                        http_client=http, max_retries=0, **options).bind_tools([get_weather])
    messages: list = []
    for text in texts:
        messages.append(HumanMessage(text))
        while True:
            if stream:
                ai = None
                for chunk in llm.stream(messages):
                    ai = chunk if ai is None else ai + chunk
            else:
                ai = llm.invoke(messages)
            messages.append(ai)
            if not ai.tool_calls:
                break
            for call in ai.tool_calls:
                messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
