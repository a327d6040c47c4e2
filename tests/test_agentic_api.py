"""vLLM's agentic-api (a stateful Rust gateway, tests/agentic_server.py) as
the upstream, the emulator behind it as its model server, mitmdump with the
addon in front, driven by the real openai SDK. agentic-api stores responses
and conversations, but its answers carry no ``store``, name a conversation as
``conversation_id``, refuse DELETE (405) and forget everything on a restart
(its database is in memory here). On every turn the model sees exactly the
context the client meant.

agentic-api sends each easy message (``{"role", "content"}``) on as a typed
one (``"type": "message"`` added), with or without a proxy: the contexts are
compared with that one field added. A stored request that resends an item id
agentic-api already holds is its 500 ("failed to persist response"), with or
without a proxy: the full-history clients here send their items without ids.
"""

from __future__ import annotations

import re

import openai
import pytest
from mitmproxy import io
from driver import INSTRUCTIONS, ToolAgent, drop_nulls, httpx, user_turns


def as_agentic_sends(items: list) -> list:
    """Items as agentic-api sends them on: easy messages typed, nulls dropped."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    typed = [{"type": "message", **item} if "role" in item and "type" not in item else item for item in items]
    return drop_nulls(typed)


def without_id(item: dict) -> dict:
    return {key: value for key, value in item.items() if key != "id"}


class Agent(ToolAgent):
    """A tool-using conversation with agentic-api behind ``base_url``: a full-history client sends its items
    without ids. Each request's meaning (the whole context it means) is kept with the answer's output item ids,
    which agentic-api passes on from the model server: they find the model server's record of the turn."""

    model = "m"

    def __init__(self, base_url: str, *, chained: bool, stream: bool = False, **options) -> None:
        super().__init__(openai.OpenAI(base_url=base_url + "/v1", api_key="sk-agentic", max_retries=0),
                         chained=chained, stream=stream, **options)
        self.meant: list[tuple[list, list[str]]] = []  # (the whole context, the answer's output ids)

    def _meant(self, context: list[dict], output: list[dict]) -> None:
        self.meant.append((context, [item["id"] for item in output]))

    def _kept(self, output: list[dict]) -> list[dict]:
        return output if self.chained else [without_id(item) for item in output]


def six_exact_turns(proxy, emulator, *, chained: bool, stream: bool = False) -> Agent:
    """Six turns of an agent through ``proxy``, each one's context checked; the agent, closed."""
    agent = Agent(proxy.url, chained=chained, stream=stream)
    for text in user_turns(6):
        agent.turn(text)
    agent.close()
    assert_every_turn_exact(agent, emulator)
    return agent


def assert_every_turn_exact(agent: Agent, emulator) -> None:
    """The model server's context for each answer the client got is the whole
    context the client meant (its chain; or its full history, whose items it
    sends without ids, which a continued chain's items carry)."""
    made = {tuple(item["id"] for item in record["output"]): record
            for record in emulator.model.snapshot_log() if record.get("status_code") == 200}
    for n, (meant, output_ids) in enumerate(agent.meant):
        record = made.get(tuple(output_ids))
        assert record is not None, f"request {n}: the model server never made the answer the client got"
        seen = record["context"] if agent.chained else [without_id(item) for item in record["context"]]
        assert as_agentic_sends(seen) == as_agentic_sends(meant), f"request {n}: the context differs"
        assert record["instructions"] == INSTRUCTIONS


class Relay:
    """A plain mitmdump (no addon) between the proxy and agentic-api that
    saves every flow: what reached agentic-api, and its answers."""

    def __init__(self, start_proxy, upstream: str, directory) -> None:
        self.path = directory / "relayed.flows"
        self.process = start_proxy(upstream, "--set", f"save_stream_file={self.path}", script=False)
        self.url = self.process.url

    def responses(self, method: str, status: int | None = None) -> int:
        """How many requests to ``/v1/responses…`` it relayed (so far answered ``status``)."""
        self.process.stop()
        with open(self.path, "rb") as saved:
            flows = list(io.FlowReader(saved).stream())
        return sum(1 for flow in flows if flow.request.method == method and "/v1/responses" in flow.request.path
                   and (status is None or flow.response is not None and flow.response.status_code == status))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_previous_response_id_client_in_auto_mode_is_continued_by_agentic_api(
        agentic_server, emulator, start_proxy, tmp_path, stream):
    """Its answers say nothing of ``store``: the proof's GET shows agentic-api
    keeps them, so the client's ids go to it as they are (its own chain
    serves them) and nothing is expanded; every request is answered once."""
    counter = Relay(start_proxy, agentic_server.url, tmp_path)
    proxy = start_proxy(counter.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    agent = six_exact_turns(proxy, emulator, chained=True, stream=stream)
    output = proxy.stop()
    assert "internal error" not in output
    # its first chain holding function calls was expanded, continued from the client's own id (only the
    # client's input sent) and compared with the turn sent whole: agentic-api keeps them, so every other
    # turn's id went to it as it was
    assert output.count("stateful-responses: expanded") == 1, output
    assert output.count("in its stored chain (") == 1, output
    assert counter.responses("POST") == len(agent.meant) + 1
    assert counter.responses("GET") == 1  # the proof: agentic-api read a stored response back


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["bridge", "http-unforced"])
def test_a_previous_response_id_clients_first_answer_teaches_store_emulation_on_every_transport(
        agentic_server, emulator, start_proxy, path, stream):
    """The first turn (no previous_response_id) goes over agentic-api's WebSocket mode with the bridge (the
    default), or over HTTP without a forced store: either way its answer, which does not say ``store``, is
    judged by its request's (none said: the API's default), and the proof's GET shows agentic-api keeps it.
    So the client's ids go on as they are: never an expansion resending item ids agentic-api holds (its
    500, "failed to persist response")."""
    options = {"upstream_websocket": "auto"} if path == "bridge" else {}
    extra = ("--set", "stateful_force_store=false") if path == "http-unforced" else ()
    proxy = start_proxy(agentic_server.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true",
                        *extra, **options)
    six_exact_turns(proxy, emulator, chained=True, stream=stream)
    output = proxy.stop()
    assert "internal error" not in output
    # a chain expanded (one holding an item kind agentic-api has not yet shown it keeps: usage proof) goes on as
    # a continuation of the client's own id, never whole with the item ids agentic-api holds
    assert output.count(": expanded resp_") <= len(re.findall(r"rewritten .* previous resp_", output))
    if path == "bridge":
        assert "ws: full: 1 items" in output


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_previous_response_id_client_in_always_mode_keeps_its_context(agentic_server, emulator, start_proxy,
                                                                       stream):
    """The proxy expands every chain, and forward mode sends the expansion on
    as a continuation of agentic-api's own stored chain (the echo checked
    before the client has the answer): it never resends the chain's item ids,
    which agentic-api would refuse (its 500)."""
    proxy = start_proxy(agentic_server.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true")
    agent = six_exact_turns(proxy, emulator, chained=True, stream=stream)
    output = proxy.stop()
    assert "internal error" not in output and "retries=0 " in output
    # all but the first (a proof slowed past its 2 s wait on a loaded machine may send one more whole)
    assert int(re.search(r"continued=(\d+)", output).group(1)) >= len(agent.meant) - 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_full_history_client_is_continued_from_its_second_request(agentic_server, emulator, start_proxy, stream):
    """agentic-api's answers do not say ``store``: the forced ``store: true``
    is taken as its answer, the proof's GET reads the response back, and the
    first continued answer echoes its ``previous_response_id``."""
    proxy = start_proxy(agentic_server.url, "--set", "stateful_debug=true")
    agent = Agent(proxy.url, chained=False, stream=stream)
    sent: list[int] = []
    agent.client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agentic", max_retries=0,
                                 http_client=httpx.Client(event_hooks={"request": [
                                     lambda request: sent.append(len(request.read()))
                                     if request.url.path.endswith("/responses") else None]}, trust_env=False))
    for text in user_turns(12):
        agent.turn(text)
    agent.close()
    assert_every_turn_exact(agent, emulator)
    output = proxy.stop()
    saved = int(re.search(r"bytes_saved=(-?\d+)", output).group(1))
    continued = int(re.search(r"continued=(\d+)", output).group(1))
    ratio = (sum(sent) - saved) / sum(sent)
    print(f"\nagentic-api, {'sse' if stream else 'json'}: {continued} of {len(sent)} requests continued, "
          f"{sum(sent) - saved} bytes sent for the client's {sum(sent)} ({ratio:.2f})")
    # all but the first (15 of 16 measured; a proof slowed past its 2 s wait may send one more whole)
    assert continued >= len(sent) - 2 and "from now on" not in output
    assert ratio < 0.5


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_full_history_client_is_continued_and_refused_at_most_once_after_agentic_api_forgets(
        agentic_server, emulator, start_proxy, tmp_path, stream):
    """agentic-api restarted (its store in memory): the next continuation is
    refused (404) and resent whole, the whole branch forgotten with it, so
    no later turn is continued from an older ancestor; then it is stored and
    continued again."""
    counter = Relay(start_proxy, agentic_server.url, tmp_path)
    proxy = start_proxy(counter.url, "--set", "stateful_debug=true")
    agent = Agent(proxy.url, chained=False, stream=stream)
    for text in user_turns(3):
        agent.turn(text)
    before = len(agent.meant)
    agentic_server.stop()
    agentic_server.start()  # same port, empty store
    for text in user_turns(4, "again "):
        agent.turn(text)
    agent.close()
    assert_every_turn_exact(agent, emulator)
    output = proxy.stop()
    after = len(agent.meant) - before
    assert counter.responses("POST", 404) == 1
    compared = output.count("in its stored chain (")  # the first continuation across each new item kind
    assert 1 <= compared <= 2, output
    assert counter.responses("POST") == len(agent.meant) + 1 + compared
    continued = int(re.search(r"continued=(\d+)", output).group(1))
    # after the refusal, every turn but the one stored anew is continued again (before it, a proof that takes
    # over 2 s on a loaded machine may send a request or two whole: correct, no saving)
    assert after - 1 <= continued <= (before - 1) + (after - 1)


def test_a_full_history_client_over_agentic_apis_websocket_mode(agentic_server, emulator, start_proxy):
    """The bridge (on by default) holds a socket to agentic-api's WebSocket
    mode and continues each turn from the socket's own memory."""
    proxy = start_proxy(agentic_server.url, "--set", "stateful_debug=true", upstream_websocket="auto")
    agent = six_exact_turns(proxy, emulator, chained=False)
    output = proxy.stop()
    turns = int(re.search(r"websocket_turns=(\d+)", output).group(1))
    print(f"\nagentic-api's WebSocket mode: {turns} of {len(agent.meant)} requests bridged")
    assert "internal error" not in output


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_conversation_agentic_api_keeps_stays_its_own(agentic_server, emulator, start_proxy, mode):
    """A conversation made at agentic-api before the proxy was there: its echo
    ``conversation_id`` names it, so in ``auto`` mode each answer stands and
    agentic-api keeps the conversation; ``always`` keeps the proxy's own
    conversations only, and one it does not know is refused."""
    direct = openai.OpenAI(base_url=agentic_server.url + "/v1", api_key="sk-agentic", max_retries=0)
    conversation = direct.conversations.create().id
    direct.close()
    proxy = start_proxy(agentic_server.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agentic", max_retries=0)
    if mode == "always":
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="m", input="hello", conversation=conversation)
        return
    first = client.responses.create(model="m", input="hello", conversation=conversation)
    second = client.responses.create(model="m", input="again", conversation=conversation)
    log = [record for record in emulator.model.snapshot_log() if record.get("status_code") == 200]
    assert [record["context"] for record in log] == [
        as_agentic_sends("hello"),
        as_agentic_sends("hello") + [first.output[0].model_dump(exclude_unset=True)] + as_agentic_sends("again"),
    ]
    items = client.conversations.items.list(conversation, order="asc").data
    assert [item.id for item in items if item.role == "assistant"] == [first.output[0].id, second.output[0].id]
    client.close()
    output = proxy.stop()
    assert "lacks the Conversations API" not in output and "answered by the proxy" not in output


def test_conversations_made_through_the_proxy_are_agentic_apis(agentic_server, emulator, start_proxy):
    proxy = start_proxy(agentic_server.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agentic", max_retries=0)
    conversation = client.conversations.create().id
    first = client.responses.create(model="m", input="hello", conversation=conversation)
    client.responses.create(model="m", input="again", conversation=conversation)
    client.close()
    log = [record for record in emulator.model.snapshot_log() if record.get("status_code") == 200]
    assert log[-1]["context"] == (as_agentic_sends("hello") + [first.output[0].model_dump(exclude_unset=True)]
                                  + as_agentic_sends("again"))
    assert "lacks the Conversations API" not in proxy.stop()


def test_a_delete_agentic_api_refuses_is_the_clients_to_see_in_auto_mode(agentic_server, emulator, start_proxy):
    """agentic-api has no DELETE (405) and keeps serving the response: in
    ``auto`` mode, where GETs and continuations go to it, the client gets its
    405, as without the proxy."""
    proxy = start_proxy(agentic_server.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agentic", max_retries=0)
    made = client.responses.create(model="m", input="hello", store=True)
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.delete(made.id)
    assert refused.value.status_code == 405
    assert client.responses.retrieve(made.id).id == made.id  # agentic-api still has it
    later = client.responses.create(model="m", input="again", previous_response_id=made.id)
    assert later.status == "completed"
    assert emulator.model.snapshot_log()[-1]["context"] == (
        as_agentic_sends("hello") + [made.output[0].model_dump(exclude_unset=True)] + as_agentic_sends("again"))
    client.close()
    proxy.stop()


def test_a_delete_in_always_mode_is_the_proxys_and_the_id_is_never_served_again(agentic_server, emulator,
                                                                               start_proxy):
    """In ``always`` mode the proxy serves its own copy only: a DELETE is
    answered as done once its record is gone, whatever agentic-api said
    (405), and the proxy never serves that id again."""
    proxy = start_proxy(agentic_server.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agentic", max_retries=0)
    made = client.responses.create(model="m", input="hello", store=True)
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="again", previous_response_id=made.id)
    client.close()
    proxy.stop()
