"""SGLang's Shepherd Model Gateway (smg, tests/smg_server.py) as the upstream,
the emulator behind it as its model server, mitmdump with the addon in front,
driven by the real openai SDK. smg stores responses and conversations itself
(in memory, lost on a restart; or in Redis), expands ``previous_response_id``
and ``conversation`` toward its model server, refuses the WebSocket upgrade
(405) and answers a forgotten id with 400 ``previous_response_not_found``.

smg sends every input item on as a typed message with an id and a status of
its own, so the contexts are compared in meaning (``driver.meaning``). smg is
started once for the module (its wall time); each test names its own
conversations and reads the emulator's log from where it started.
"""

from __future__ import annotations

import re

import openai
import pytest
from driver import ToolAgent, httpx, meaning, user_turns
from redis_server import start_redis_server
from smg_server import SmgServer
from stateful_responses.emulator import Emulator


@pytest.fixture(scope="module")
def model_server():
    with Emulator() as emulator:
        yield emulator


@pytest.fixture(scope="module")
def smg(model_server, tmp_path_factory):
    """smg with its memory backend in front of the module's emulator."""
    server = SmgServer(model_server.url, tmp_path_factory.mktemp("smg"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def emulator(model_server):
    """The module's emulator, its faults cleared (its log read from each test's start: ``Agent.start``)."""
    model_server.model.faults.next.clear()
    return model_server


def served(emulator, start: int) -> list[dict]:
    """The model server's answered requests since ``start``, less the proxy's comparisons: the first
    continuation of a conversation holding an item kind smg has not shown it keeps is sent whole too, right
    after (smg expands both, so the model server sees the same context twice in a row)."""
    kept: list[dict] = []
    for record in emulator.model.snapshot_log()[start:]:
        if record.get("status_code") != 200:
            continue
        if kept and kept[-1].get("credential") == record.get("credential") \
                and "context" in record and meaning(kept[-1].get("context")) == meaning(record["context"]):
            continue
        kept.append(record)
    return kept


class Agent(ToolAgent):
    """A tool-using conversation with smg behind ``base_url`` (output items go back as the SDK returned them,
    ids included): what each request meant (the whole context) is kept, and the bytes of every request body
    sent."""

    def __init__(self, base_url: str, emulator, *, chained: bool, stream: bool = False,
                 key: str = "sk-smg", **options) -> None:
        self.sent: list[int] = []
        super().__init__(openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, http_client=httpx.Client(
            event_hooks={"request": [self._count]}, trust_env=False, timeout=60)),
                         chained=chained, stream=stream, **options)
        self.start = len(emulator.model.snapshot_log())

    def _count(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/responses"):
            self.sent.append(len(request.read()))

    def assert_exact(self, emulator) -> None:
        """The model server's context for every answer is the whole context the client meant (its
        requests told from others' by the credential smg passes on)."""
        seen = served(emulator, self.start)
        seen = [record for record in seen if record["credential"] == seen[0]["credential"]]
        assert len(seen) == len(self.meant), (len(seen), len(self.meant))
        for n, (meant, record) in enumerate(zip(self.meant, seen, strict=True)):
            assert meaning(record["context"]) == meaning(meant), f"request {n}: the model saw another context"


def final_stats(output: str) -> dict[str, int]:
    line = [line for line in output.splitlines() if "continued=" in line][-1]
    return {name: int(value) for name, value in re.findall(r"(\w+)=(-?\d+)", line)}


# -- forward mode ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_full_history_client_is_continued_with_its_exact_context(smg, emulator, start_proxy, stream):
    """smg echoes ``store: true`` and the continuation's ``previous_response_id``, and its GET reads a
    stored response back: every request from the second on is continued, each turn exact."""
    proxy = start_proxy(smg.url, "--set", "stateful_debug=true")
    agent = Agent(proxy.url, emulator, chained=False, stream=stream).converse(user_turns(10))
    agent.close()
    agent.assert_exact(emulator)
    counts = final_stats(proxy.stop())
    ratio = (sum(agent.sent) - counts["bytes_saved"]) / sum(agent.sent)
    print(f"\nsmg, {'sse' if stream else 'json'}: {counts['continued']} of {len(agent.sent)} requests continued, "
          f"{sum(agent.sent) - counts['bytes_saved']} bytes sent for the client's {sum(agent.sent)} ({ratio:.2f})")
    # all but the first (a proof slowed past its 2 s wait on a loaded machine may send one more whole)
    assert counts["continued"] >= len(agent.sent) - 2 and counts["errors"] == 0
    assert ratio < 0.4


def test_a_full_history_client_after_smg_restarts_is_refused_once_and_continued_again(smg, emulator,
                                                                                      start_proxy):
    """smg's memory backend forgets everything on a restart: the next continuation meets its 400
    ``previous_response_not_found``, is resent whole invisibly, and the conversation is continued again;
    a forgotten id is a fact about that id: no verdict on the upstream (issue 46)."""
    proxy = start_proxy(smg.url, "--set", "stateful_debug=true")
    agent = Agent(proxy.url, emulator, chained=False).converse(user_turns(3))
    smg.restart()
    agent.converse(user_turns(4, "again "))
    agent.close()
    agent.assert_exact(emulator)
    output = proxy.stop()
    counts = final_stats(output)
    assert counts["retries"] == 1 and counts["continued"] >= len(agent.sent) - 4
    assert "from now on" not in output


# -- store emulation -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_previous_response_id_client_keeps_its_exact_context(smg, emulator, start_proxy, mode, stream):
    proxy = start_proxy(smg.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    agent = Agent(proxy.url, emulator, chained=True, stream=stream).converse(user_turns(6))
    agent.close()
    agent.assert_exact(emulator)
    output = proxy.stop()
    assert "internal error" not in output and "from now on" not in output


def test_a_fork_of_an_earlier_response_keeps_its_own_context(smg, emulator, start_proxy):
    """Two branches from one response, through store emulation's auto mode: each continues its own."""
    proxy = start_proxy(smg.url, "--set", "stateful_emulate=auto")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-smg", max_retries=0)
    root = client.responses.create(model="gpt-test", input="the root")
    start = len(emulator.model.snapshot_log())
    left = client.responses.create(model="gpt-test", input="left", previous_response_id=root.id)
    right = client.responses.create(model="gpt-test", input="right", previous_response_id=root.id)
    client.responses.create(model="gpt-test", input="left again", previous_response_id=left.id)
    client.close()
    root_context = [{"role": "user", "content": "the root"}] + [o.model_dump(exclude_unset=True) for o in root.output]
    left_seen, right_seen, again_seen = served(emulator, start)
    assert meaning(left_seen["context"]) == meaning(root_context + [{"role": "user", "content": "left"}])
    assert meaning(right_seen["context"]) == meaning(root_context + [{"role": "user", "content": "right"}])
    assert meaning(again_seen["context"]) == meaning(
        root_context + [{"role": "user", "content": "left"}] + [o.model_dump(exclude_unset=True) for o in left.output]
        + [{"role": "user", "content": "left again"}])
    assert right.id != left.id


def test_a_forgotten_id_is_expanded_and_teaches_nothing_about_the_upstream(smg, emulator, start_proxy):
    """``auto``: smg restarted and forgot the client's previous response; the proxy's record answers the
    rescue (the chain expanded, invisibly). The forgotten id says nothing about the field: smg had shown
    it honours it, so a new ``previous_response_id`` conversation goes to smg as it is, and a full-history
    one is still continued (issue 46, item 2)."""
    proxy = start_proxy(smg.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    chained = Agent(proxy.url, emulator, chained=True).converse(user_turns(3))
    smg.restart()
    chained.converse(user_turns(2, "after the restart "))
    chained.close()
    chained.assert_exact(emulator)
    fresh = Agent(proxy.url, emulator, chained=True).converse(user_turns(3, "a new one "))
    fresh.close()
    fresh.assert_exact(emulator)
    full = Agent(proxy.url, emulator, chained=False).converse(user_turns(4, "full "))
    full.close()
    full.assert_exact(emulator)
    output = proxy.stop()
    assert "expanding chains for it from now on" not in output
    assert output.count(" expanded once") == 1  # the rescue alone
    # the new conversation's ids went to smg as they were: a chain expanded for the usage proof (an item kind smg
    # has not yet shown it keeps) goes on as a continuation of the client's own id
    assert output.count(": expanded resp_") <= len(re.findall(r"rewritten .* previous resp_", output))
    assert final_stats(output)["continued"] >= len(full.sent) - 2


def test_always_continues_a_response_smg_holds_that_the_proxy_never_recorded(smg, emulator, start_proxy):
    """``always``, a credential that has proved nothing yet: a ``previous_response_id`` the proxy never
    recorded (made at smg directly) is settled by one GET of that id, not answered
    ``previous_response_not_found`` by the proxy (issue 46, item 3)."""
    direct = openai.OpenAI(base_url=smg.url + "/v1", api_key="sk-smg-direct", max_retries=0)
    made = direct.responses.create(model="gpt-test", input="made before the proxy")
    direct.close()
    proxy = start_proxy(smg.url, "--set", "stateful_emulate=always")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-smg-direct", max_retries=0)
    start = len(emulator.model.snapshot_log())
    answer = client.responses.create(model="gpt-test", input="and now", previous_response_id=made.id)
    client.close()
    (seen,) = served(emulator, start)
    assert meaning(seen["context"]) == meaning([{"role": "user", "content": "made before the proxy"}]
                                               + [o.model_dump(exclude_unset=True) for o in made.output]
                                               + [{"role": "user", "content": "and now"}])
    assert answer.previous_response_id == made.id


def test_a_delete_reaches_smg_and_the_record(smg, emulator, start_proxy):
    """``auto``: a DELETE goes to smg and to the proxy's record; the id then continues nowhere."""
    proxy = start_proxy(smg.url, "--set", "stateful_emulate=auto")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-smg", max_retries=0)
    first = client.responses.create(model="gpt-test", input="forget me")
    client.responses.delete(first.id)
    start = len(emulator.model.snapshot_log())
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=smg.url + "/v1", api_key="sk-smg", max_retries=0).responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="gpt-test", input="again", previous_response_id=first.id)
    client.close()
    assert served(emulator, start) == []  # the deleted chain reached no model


# -- conversations ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_conversation_client_keeps_its_exact_context(smg, emulator, start_proxy, mode):
    """``auto``: the conversation is smg's (passed through); ``always``: the proxy's, each turn's
    expansion continued from smg's stored chain from the second on, its first continuation held and
    checked (issue 46, item 4: a JSON answer in a conversation can be held)."""
    proxy = start_proxy(smg.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-smg", max_retries=0)
    conversation = client.conversations.create().id
    start, meant = len(emulator.model.snapshot_log()), []
    for text in user_turns(4, f"{mode} "):
        response = client.responses.create(model="gpt-test", input=text, conversation=conversation)
        meant.append([{"role": "user", "content": text}] + [o.model_dump(exclude_unset=True)
                                                             for o in response.output])
    items = client.conversations.items.list(conversation, order="asc", limit=100).data
    client.close()
    seen = served(emulator, start)
    for n, record in enumerate(seen):
        assert meaning(record["context"]) == meaning(sum(meant[:n], []) + meant[n][:1]), f"request {n}"
    assert len(items) == 8
    kept_by_smg = openai.OpenAI(base_url=smg.url + "/v1", api_key="sk-smg", max_retries=0)
    if mode == "auto":
        assert len(kept_by_smg.conversations.items.list(conversation, limit=100).data) == 8
    else:
        with pytest.raises(openai.NotFoundError):
            kept_by_smg.conversations.retrieve(conversation)
    kept_by_smg.close()
    output = proxy.stop()
    assert "lacks the Conversations API" not in output
    if mode == "always":  # the proxy's conversation, expanded, is continued once smg showed it honours the field
        assert final_stats(output)["continued"] >= len(seen) - 2


def test_smgs_own_not_found_is_not_taken_for_a_missing_api(smg, emulator, start_proxy):
    """``auto``: a credential's first conversation calls meet smg's legitimate 404s (a conversation lost
    in a restart, an unknown item); they are facts about those ids: the conversations smg holds stay
    smg's and reachable through the proxy (issue 46, item 1)."""
    direct = openai.OpenAI(base_url=smg.url + "/v1", api_key="sk-smg-404", max_retries=0)
    held = direct.conversations.create().id
    direct.responses.create(model="gpt-test", input="kept by smg", conversation=held)
    proxy = start_proxy(smg.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-smg-404", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve("conv_lost_in_a_restart")
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("msg_unknown", conversation_id=held)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-test", input="x", conversation="conv_lost_in_a_restart")
    assert client.conversations.retrieve(held).id == held
    client.responses.create(model="gpt-test", input="through the proxy", conversation=held)
    assert len(direct.conversations.items.list(held, limit=100).data) == 4  # smg's conversation grew
    created = client.conversations.create().id
    assert direct.conversations.retrieve(created).id == created  # a new one is smg's too
    client.close()
    direct.close()
    output = proxy.stop()
    assert "lacks the Conversations API" not in output and "answered by the proxy" not in output


# -- smg's Redis history backend ---------------------------------------------------------


def test_smgs_redis_history_outlives_its_restart_through_the_proxy(model_server, emulator, start_proxy, tmp_path):
    """With ``--history-backend redis`` against the tests' Redis, smg restarts without forgetting: a
    full-history client is continued throughout (no refusal), a ``previous_response_id`` client and a
    conversation go on at smg, each request's context exact."""
    redis = start_redis_server(tmp_path / "redis")
    server = SmgServer(model_server.url, tmp_path / "smg", redis=redis.url)
    try:
        server.start()
        proxy = start_proxy(server.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
        full = Agent(proxy.url, emulator, chained=False, key="sk-smg-full").converse(user_turns(3))
        chained = Agent(proxy.url, emulator, chained=True, key="sk-smg-chained").converse(user_turns(2))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-smg-conv", max_retries=0)
        conversation = client.conversations.create().id
        client.responses.create(model="gpt-test", input="before the restart", conversation=conversation)
        server.restart()
        full.converse(user_turns(3, "after the restart "))
        full.close()
        full.assert_exact(emulator)
        chained.converse(user_turns(2, "after the restart "))
        chained.close()
        start = len(emulator.model.snapshot_log())
        client.responses.create(model="gpt-test", input="after the restart", conversation=conversation)
        (seen,) = served(emulator, start)
        assert [item["content"][0]["text"] for item in seen["context"] if item.get("role") == "user"] == \
            ["before the restart", "after the restart"]
        client.close()
        output = proxy.stop()
        counts = final_stats(output)
        assert counts["retries"] == 0 and counts["continued"] >= len(full.sent) - 2
        assert " expanded once" not in output  # smg kept the chain: nothing for the proxy to rescue
        assert output.count(": expanded resp_") <= len(re.findall(r"rewritten .* previous resp_", output))
    finally:
        server.stop()
        redis.stop()
