"""Background responses through mitmdump with the openai SDK, against the
emulator taught each upstream behaviour: native (passed through), refusing
(vLLM's 400), ignoring (a gateway that answers synchronously), stateless
(llama.cpp, Ollama). Where the upstream has no background mode the proxy runs
the job itself: answered at once, polled, cancelled, streamed and resumed,
continued from, on two replicas, after a kill -9, never across tenants."""

from __future__ import annotations

import time

import openai
import pytest
from harness import start_mitmdump

from stateful_responses.background.jobs import is_ours

THINK_MS = 3000  # the upstream's time to answer: a long model call
NOT_NATIVE = {"refuse": {"background": "refuse"}, "ignore": {"background": "ignore"},
              "stateless": {"stateless": "ignore"}}


def client(proxy, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=60)


def poll(c: openai.OpenAI, response):
    deadline = time.monotonic() + 60
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        response = c.responses.retrieve(response.id)
    return response


def timed_create(c: openai.OpenAI, **kwargs):
    began = time.monotonic()
    response = c.responses.create(model="m", background=True, **kwargs)
    return response, time.monotonic() - began


@pytest.fixture
def proxy(emulator, start_proxy):
    return start_proxy(emulator.url, "--set", "stateful_store=memory", "--set", "stateful_emulate=auto",
                       "--set", "stateful_debug=true")


def test_a_native_upstream_runs_it_itself(emulator, proxy):
    emulator.model.control({"background_delay_ms": 1000})
    c = client(proxy)
    for _ in range(2):  # the first teaches the verdict, the second passes at once
        queued = c.responses.create(model="m", input="hello", background=True)
        assert queued.status == "queued" and queued.background and not is_ours(queued.id)
        done = poll(c, queued)
        assert done.status == "completed" and done.output_text.startswith("I saw 1 items")
    log = [r for r in emulator.model.snapshot_log() if r.get("background")]
    assert [r["response_id"] for r in log][-1] == done.id  # the upstream's own id, its own job


@pytest.mark.parametrize("behaviour", sorted(NOT_NATIVE))
def test_an_upstream_without_background_mode_gets_it_from_the_proxy(emulator, proxy, behaviour):
    emulator.model.control({**NOT_NATIVE[behaviour], "think_ms": THINK_MS})
    c = client(proxy)
    foreground = c.responses.create(model="m", input="hello")
    for _ in range(2):  # the first create probes the upstream, the second knows it
        queued, took = timed_create(c, input="hello")
        assert took < THINK_MS / 1000  # answered while the upstream still thinks
        assert (queued.status, queued.background, queued.output, queued.usage) == ("queued", True, [], None)
        assert is_ours(queued.id)
        done = poll(c, queued)
        assert (done.id, done.status, done.background) == (queued.id, "completed", True)
        assert done.output_text == foreground.output_text  # polled to completion = a foreground run
        assert [i.model_dump() for i in done.output] == [
            {**i.model_dump(), "id": d.id} for i, d in zip(foreground.output, done.output)]
        assert done.usage == foreground.usage
    answered = [r for r in emulator.model.snapshot_log() if r.get("status_code") == 200]
    assert len(answered) == 3  # one model call each: the foreground run and the two jobs (a probe answered is one)
    assert answered[-1]["stream"] and not answered[-1]["background"]  # a job runs in the foreground, streamed


def test_a_finished_job_is_continued_from(emulator, proxy):
    emulator.model.control({"background": "refuse"})
    c = client(proxy)
    done = poll(c, c.responses.create(model="m", input="hello", background=True))
    following = c.responses.create(model="m", input="next", previous_response_id=done.id)
    assert following.output_text.startswith("I saw 3 items")  # hello, the job's answer, next
    assert emulator.model.snapshot_log()[-1]["context"][1]["content"] == [
        o.model_dump(exclude_none=True) for o in done.output][0]["content"]


def test_cancel_abandons_the_upstream_request_and_is_idempotent(emulator, proxy):
    emulator.model.control({"background": "ignore", "think_ms": THINK_MS * 3})
    c = client(proxy)
    queued = c.responses.create(model="m", input="hello", background=True)
    cancelled = c.responses.cancel(queued.id)
    assert (cancelled.id, cancelled.status, cancelled.output) == (queued.id, "cancelled", [])
    assert c.responses.cancel(queued.id).status == "cancelled"
    time.sleep(1)
    assert c.responses.retrieve(queued.id).status == "cancelled"
    done = poll(c, c.responses.create(model="m", input="again", background=True))
    assert c.responses.cancel(done.id) == done  # a finished one comes back unchanged
    foreground = c.responses.create(model="m", input="x")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        c.responses.cancel(foreground.id)


@pytest.mark.parametrize("behaviour", ["refuse", "native"])
def test_a_dropped_stream_resumes_after_any_event_without_gap_or_duplicate(emulator, proxy, behaviour):
    emulator.model.control({"background": None if behaviour == "native" else "refuse", "slow_ms": 100,
                            "background_delay_ms": 400})
    c = client(proxy)
    stream = c.responses.create(model="m", input="tell me a long story", background=True, stream=True)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    response_id = first[0].response.id
    if behaviour != "native":  # the proxy's job: its events came as the upstream made them
        assert c.responses.retrieve(response_id).status == "in_progress"
    stream.close()  # the connection drops; the job goes on
    cursor = first[-1].sequence_number
    rest = list(c.responses.retrieve(response_id, stream=True, starting_after=cursor))
    numbers = [e.sequence_number for e in first + rest]
    assert numbers == list(range(len(numbers)))
    assert rest[-1].type == "response.completed"
    final = c.responses.retrieve(response_id)
    assert rest[-1].response.output_text == final.output_text and final.status == "completed"
    replayed = list(c.responses.retrieve(response_id, stream=True))  # the whole stream again, from the first
    assert [e.sequence_number for e in replayed] == numbers
    assert [e.type for e in replayed][:3] == ["response.created", "response.queued", "response.in_progress"]
    with c.responses.stream(response_id=response_id, starting_after=cursor) as resumed:
        assert resumed.get_final_response().output_text == final.output_text


def test_tenants_never_see_cancel_or_resume_each_others_jobs(emulator, proxy):
    emulator.model.control({"background": "refuse", "think_ms": THINK_MS})
    mine, theirs = client(proxy, "sk-a"), client(proxy, "sk-b")
    queued = mine.responses.create(model="m", input="hello", background=True)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(queued.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.cancel(queued.id)
    with pytest.raises(openai.NotFoundError):
        list(theirs.responses.retrieve(queued.id, stream=True))
    assert poll(mine, queued).status == "completed"


def test_two_replicas_on_redis_and_a_kill_9_mid_job(emulator, redis_server):
    emulator.model.control({"background": "refuse", "think_ms": THINK_MS})
    options = ("--set", f"stateful_store={redis_server.url}", "--set", "stateful_background_lease_s=2")
    a, b = start_mitmdump(emulator.url, *options), start_mitmdump(emulator.url, *options)
    try:
        on_a, on_b = client(a), client(b)
        queued = on_a.responses.create(model="m", input="hello", background=True, stream=True)
        first = next(iter(queued))
        queued = first.response
        assert on_b.responses.retrieve(queued.id).status in ("queued", "in_progress")
        live = list(on_b.responses.retrieve(queued.id, stream=True, starting_after=0))  # while A runs it
        assert [e.sequence_number for e in live] == list(range(1, len(live) + 1))
        assert live[-1].type == "response.completed"
        done = poll(on_b, queued)  # polled on the other replica to the end
        assert done.status == "completed" and done.output_text.startswith("I saw 1 items")
        events = list(on_b.responses.retrieve(queued.id, stream=True, starting_after=1))
        assert events[0].sequence_number == 2 and events[-1].type == "response.completed"
        following = on_b.responses.create(model="m", input="next", previous_response_id=done.id)
        assert following.output_text.startswith("I saw 3 items")

        emulator.model.control({"think_ms": THINK_MS * 4})
        orphan = on_a.responses.create(model="m", input="hello", background=True)
        a.kill()  # kill -9 while its job runs
        ended = poll(on_b, orphan)
        assert ended.status == "failed" and "stopped before it finished" in ended.error.message
        assert on_b.responses.retrieve(orphan.id).status == "failed"
    finally:
        a.stop()
        b.stop()


def test_a_job_continues_a_chain_the_proxy_keeps_and_is_deleted(emulator, proxy):
    emulator.model.control({"stateless": "ignore"})  # keeps nothing: store emulation expands the chain
    c = client(proxy)
    first = c.responses.create(model="m", input="hello")
    job = poll(c, c.responses.create(model="m", input="more", previous_response_id=first.id, background=True))
    assert job.status == "completed" and job.output_text.startswith("I saw 3 items")
    third = c.responses.create(model="m", input="last", previous_response_id=job.id)
    assert third.output_text.startswith("I saw 5 items")
    assert c.responses.delete(job.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(job.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        c.responses.create(model="m", input="x", previous_response_id=job.id)


def test_an_unfinished_job_is_no_previous_response_yet(emulator, proxy):
    emulator.model.control({"background": "refuse", "think_ms": THINK_MS})
    c = client(proxy)
    queued = c.responses.create(model="m", input="hello", background=True, store=False)
    assert queued.store is False
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|not found"):
        c.responses.create(model="m", input="next", previous_response_id=queued.id)
    assert poll(c, queued).status == "completed"


def test_off_passes_every_background_request(emulator, start_proxy):
    emulator.model.control({"background": "refuse"})
    off = start_proxy(emulator.url, "--set", "stateful_store=memory", "--set", "stateful_background=off")
    with pytest.raises(openai.BadRequestError, match="does not support the background mode"):
        client(off).responses.create(model="m", input="hello", background=True)


def test_jobs_at_once_are_bounded_per_credential_across_replicas(emulator, redis_server):
    emulator.model.control({"background": "refuse", "think_ms": THINK_MS})
    options = ("--set", f"stateful_store={redis_server.url}", "--set", "stateful_background_jobs_per_credential=1")
    a, b = start_mitmdump(emulator.url, *options), start_mitmdump(emulator.url, *options)
    try:
        running = client(a).responses.create(model="m", input="hello", background=True)
        with pytest.raises(openai.BadRequestError, match="does not support the background mode"):
            client(b).responses.create(model="m", input="hello", background=True)  # beyond: as without the proxy
        assert client(b, "sk-b").responses.create(model="m", input="hello", background=True).status == "queued"
        assert poll(client(b), running).status == "completed"
        assert client(b).responses.create(model="m", input="again", background=True).status == "queued"
    finally:
        a.stop()
        b.stop()


def test_a_proxy_killed_mid_job_fails_it_once_restarted(emulator, tmp_path):
    """The default store (SQLite), one proxy: killed with -9 while its job runs,
    then started again on its confdir and port. Its lease (10 minutes here)
    names it, so the restarted proxy knows the job died with it at once."""
    emulator.model.control({"background": "ignore", "think_ms": THINK_MS * 4})
    options = ("--set", "stateful_background_lease_s=600")
    first = start_mitmdump(emulator.url, *options, confdir=str(tmp_path))
    try:
        queued = client(first).responses.create(model="m", input="hello", background=True)
        first.kill()
        again = start_mitmdump(emulator.url, *options, confdir=str(tmp_path), port=first.port)
        try:
            ended = client(again).responses.retrieve(queued.id)
            assert ended.status == "failed" and "stopped before it finished" in ended.error.message
            assert client(again).responses.create(model="m", input="x", background=True).status == "queued"
        finally:
            again.stop()
    finally:
        first.stop()
