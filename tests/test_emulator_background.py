"""Background responses: answered at once as queued, then in progress, then
finished after ``background_delay_ms``; polled with GET, cancellable, and
continued from once completed."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from driver import httpx


def request(emu, method: str, path: str, body=None, key: str = "sk-a") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.request(method, emu.url + path, json=body, headers={"authorization": f"Bearer {key}"})


def start(emu, **body) -> dict:
    answer = request(emu, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def poll_until_finished(emu, response_id: str) -> tuple[set[str], dict]:
    """Every status seen while polling, and the finished response."""
    seen, deadline = set(), time.monotonic() + 10
    while time.monotonic() < deadline:
        current = request(emu, "GET", f"/v1/responses/{response_id}").json()
        seen.add(current["status"])
        if current["status"] not in ("queued", "in_progress"):
            return seen, current
        time.sleep(0.01)
    raise AssertionError(f"{response_id} never finished (saw {seen})")


def test_answered_queued_then_polled_to_completion(emulator):
    emulator.model.control({"background_delay_ms": 2000})  # queued for 1 s: a loaded machine still polls in time
    queued = start(emulator)
    assert (queued["status"], queued["background"], queued["output"], queued["usage"]) == ("queued", True, [], None)
    assert emulator.model.snapshot_log()[-1]["stored"] is False
    seen, done = poll_until_finished(emulator, queued["id"])
    assert seen == {"queued", "in_progress", "completed"}
    assert done["output"][0]["content"][0]["text"].startswith("I saw 1 items") and done["completed_at"]
    record = emulator.model.snapshot_log()[-1]
    assert (record["response_id"], record["stored"], record["output"]) == (done["id"], True, done["output"])


def test_a_completed_background_response_is_continued_from(emulator):
    emulator.model.control({"background_delay_ms": 0})
    done = poll_until_finished(emulator, start(emulator)["id"])[1]
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "next",
                                                         "previous_response_id": done["id"]})
    assert answer.status_code == 200
    assert emulator.model.snapshot_log()[-1]["context"][1] == done["output"][0]


def test_an_unfinished_one_is_not_yet_a_previous_response(emulator):
    emulator.model.control({"background_delay_ms": 5000})
    queued = start(emulator)
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "next",
                                                         "previous_response_id": queued["id"]})
    assert answer.json()["error"]["code"] == "previous_response_not_found"


def test_cancel_stops_it_for_good_and_is_idempotent(emulator):
    emulator.model.control({"background_delay_ms": 200})
    queued = start(emulator)
    cancelled = request(emulator, "POST", f"/v1/responses/{queued['id']}/cancel").json()
    assert (cancelled["id"], cancelled["status"], cancelled["output"]) == (queued["id"], "cancelled", [])
    time.sleep(0.3)
    assert request(emulator, "GET", f"/v1/responses/{queued['id']}").json() == cancelled
    assert request(emulator, "POST", f"/v1/responses/{queued['id']}/cancel").json() == cancelled
    assert request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x",
                                                       "previous_response_id": queued["id"]}).status_code == 400
    assert emulator.model.snapshot_log()[-2]["stored"] is False


def test_cancelling_a_finished_one_returns_it_unchanged(emulator):
    emulator.model.control({"background_delay_ms": 0})
    done = poll_until_finished(emulator, start(emulator)["id"])[1]
    assert request(emulator, "POST", f"/v1/responses/{done['id']}/cancel").json() == done


def test_only_background_responses_can_be_cancelled(emulator):
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}).json()
    refused = request(emulator, "POST", f"/v1/responses/{answer['id']}/cancel")
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "Cannot cancel a synchronous response."


def test_without_store_it_can_be_polled_but_not_continued(emulator):
    emulator.model.control({"background_delay_ms": 0})
    queued = start(emulator, store=False)
    done = poll_until_finished(emulator, queued["id"])[1]
    assert (queued["store"], done["status"], done["store"]) == (False, "completed", False)
    assert request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x",
                                                       "previous_response_id": done["id"]}).status_code == 400


def test_an_injected_failure_shows_when_it_finishes(emulator):
    emulator.model.control({"background_delay_ms": 0, "fail_next": [{"kind": "failed"}]})
    queued = start(emulator)
    assert queued["status"] == "queued"
    assert poll_until_finished(emulator, queued["id"])[1]["status"] == "failed"


def events_of(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def test_streamed_it_sends_each_state_as_it_is_reached(emulator):
    emulator.model.control({"background_delay_ms": 200})
    began = time.monotonic()
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True,
                                                         "stream": True})
    events = events_of(answer.text)
    assert time.monotonic() - began >= 0.15  # the stream lasted until the response finished
    types = [event["type"] for event in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[-1] == "response.completed" and events[0]["response"]["status"] == "queued"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert request(emulator, "GET", f"/v1/responses/{final['id']}").json() == final


def streamed_so_far(emu) -> str:
    log = emu.model.snapshot_log()
    return log[-1].get("sse", "") if log else ""


def test_a_stream_cancelled_midway_ends_without_a_terminal_event(emulator):
    emulator.model.control({"background_delay_ms": 2000})
    answers = []
    streaming = threading.Thread(target=lambda: answers.append(request(
        emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True, "stream": True})))
    streaming.start()
    deadline = time.monotonic() + 10
    while "response.queued" not in streamed_so_far(emulator) and time.monotonic() < deadline:
        time.sleep(0.01)
    response_id = emulator.model.snapshot_log()[-1]["response_id"]
    request(emulator, "POST", f"/v1/responses/{response_id}/cancel")
    streaming.join(timeout=10)
    assert [event["type"] for event in events_of(answers[0].text)] == ["response.created", "response.queued"]


@pytest.mark.parametrize("delay_ms", [0, 100])
def test_the_openai_sdk_runs_a_background_response(emulator, delay_ms):
    emulator.model.control({"background_delay_ms": delay_ms})
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    response = client.responses.create(model="m", input="hello", background=True)
    while response.status in ("queued", "in_progress"):
        time.sleep(0.01)
        response = client.responses.retrieve(response.id)
    assert response.status == "completed" and response.output_text.startswith("I saw 1 items")
    client.close()


@pytest.mark.parametrize("control", [{"background": "ignore"}, {"stateless": "ignore"}])
def test_an_upstream_that_ignores_it_answers_synchronously(emulator, control):
    emulator.model.control({**control, "think_ms": 300})
    began = time.monotonic()
    answer = start(emulator)
    assert time.monotonic() - began >= 0.25  # the model's time: it ran in the foreground
    assert (answer["status"], answer["background"]) == ("completed", False)


def test_vllm_without_its_store_refuses_it_at_once(emulator):
    emulator.model.control({"background": "refuse", "think_ms": 5000})
    began = time.monotonic()
    refused = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True})
    assert time.monotonic() - began < 5
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
    assert "does not support the background mode" in refused.json()["error"]["message"]


def test_a_background_stream_is_resumed_after_any_event_or_replayed_whole(emulator):
    emulator.model.control({"background_delay_ms": 0})
    done = events_of(request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True,
                                                                 "stream": True}).text)
    response_id = done[-1]["response"]["id"]
    replayed = events_of(request(emulator, "GET", f"/v1/responses/{response_id}?stream=true").text)
    assert [e["type"] for e in replayed] == [e["type"] for e in done]
    tail = events_of(request(emulator, "GET", f"/v1/responses/{response_id}?stream=true&starting_after=3").text)
    assert [e["sequence_number"] for e in tail] == list(range(4, len(done)))
    foreground = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}).json()
    assert request(emulator, "GET", f"/v1/responses/{foreground['id']}?stream=true").status_code == 404
