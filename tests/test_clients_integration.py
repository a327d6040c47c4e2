"""Real client libraries through mitmdump and the emulator: every one keeps full
correctness and continues at least 90% of the requests it could."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from driver import (
    TOOLS,
    Conversation,
    assert_context_preserved,
    langchain_conversation,
    client_turns,
    recording_clients,
    user_turns,
    weather_agent,
)

MIN_RATE = 0.9


def continuation_rate(log: list[dict]) -> float:
    """Continued requests over eligible ones (all but the conversation's first)."""
    eligible = log[1:]
    return sum(1 for r in eligible if r["continued"]) / len(eligible)


def report(request, log) -> None:
    log = client_turns(log)  # a comparison (a turn sent whole beside its continuation) is no client's request
    rate = continuation_rate(log)
    request.node.user_properties.append(("continuation_rate", rate))
    print(f"\n{request.node.name}: {len(log)} requests, continuation rate {rate:.0%}")
    assert rate >= MIN_RATE


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_openai_async_sdk(proxy, emulator, stream, request):
    sent: list = []
    _, http = recording_clients(sent)

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-a", http_client=http, max_retries=0)
        history: list = []
        for text in user_turns(9):
            history.append({"role": "user", "content": text})
            while True:
                if stream:
                    async with await client.responses.create(model="gpt-test", input=history, tools=TOOLS,
                                                             stream=True) as events:
                        final = [e async for e in events if e.type == "response.completed"][0].response
                else:
                    final = await client.responses.create(model="gpt-test", input=history, tools=TOOLS)
                history += final.output
                calls = [o for o in final.output if o.type == "function_call"]
                if not calls:
                    break
                history += [{"type": "function_call_output", "call_id": c.call_id, "output": "21C"} for c in calls]
        await client.close()

    asyncio.run(run())
    log = emulator.model.snapshot_log()
    assert_context_preserved(sent, log)
    report(request, log)


def test_openai_agents_runner(proxy, emulator, request):
    agents = pytest.importorskip("agents")
    sent: list = []
    _, http = recording_clients(sent)

    async def run() -> None:
        agent, client = weather_agent(agents, proxy.url, http)
        history: list = []
        for text in user_turns(9):
            result = await agents.Runner.run(agent, history + [{"role": "user", "content": text}])
            history = result.to_input_list()
        await client.close()

    asyncio.run(run())
    log = emulator.model.snapshot_log()
    assert len(sent) >= 12
    assert_context_preserved(sent, log, reshaped=True)
    report(request, log)


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_openai_responses_api(proxy, emulator, stream, request):
    lc = pytest.importorskip("langchain_openai")
    sent: list = []
    http, _ = recording_clients(sent)
    langchain_conversation(lc, proxy.url, http, user_turns(9), stream=stream)
    log = emulator.model.snapshot_log()
    assert len(sent) >= 12
    assert_context_preserved(sent, log, reshaped=True)
    report(request, log)


def test_model_dump_dicts_and_sdk_objects_mixed(proxy, emulator, request):
    conv = Conversation(proxy.url)
    for n, text in enumerate(user_turns(6)):
        conv.as_dicts = n % 2 == 0
        conv.turn(text)
    conv.close()
    log = emulator.model.snapshot_log()
    assert_context_preserved(conv.sent, log)
    report(request, log)
    assert json.dumps(conv.sent[-1].body).count('"phase": null') >= 1
