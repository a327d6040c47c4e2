"""The pure core of background responses: ids, relabelling an upstream's
events, a job's state read off its log, numbering for resumes."""

from __future__ import annotations

from stateful_responses.background import jobs
from stateful_responses.background.jobs import Entry, Relabel, SSEReader


def queued() -> dict:
    return jobs.queued_response({"model": "m", "input": "x", "background": True}, jobs.mint_id(), 100)


def upstream_stream(response_id: str = "resp_up") -> list[dict]:
    final = {"id": response_id, "object": "response", "status": "completed", "background": False,
             "created_at": 5, "output": [{"type": "message", "id": "msg_1"}], "usage": {"total_tokens": 3}}
    shell = {**final, "status": "in_progress", "output": [], "usage": None}
    return [{"type": "response.created", "response": shell, "sequence_number": 0},
            {"type": "response.in_progress", "response": shell, "sequence_number": 1},
            {"type": "response.output_text.delta", "delta": "hi", "sequence_number": 2},
            {"type": "response.completed", "response": final, "sequence_number": 3}]


def test_ids_are_the_apis_shape_and_told_apart_from_the_upstreams():
    ours = jobs.mint_id()
    assert ours.startswith("resp_") and len(ours) == 53 and jobs.is_ours(ours)
    assert not jobs.is_ours("resp_" + "0" * 48) and not jobs.is_ours(ours[:-1] + "x") and not jobs.is_ours(None)


def test_a_queued_response_has_the_apis_shape():
    response = queued()
    assert (response["status"], response["background"], response["output"], response["usage"]) == (
        "queued", True, [], None)
    assert response["completed_at"] is None and response["object"] == "response"


def test_the_upstreams_events_are_relabelled_as_a_background_stream():
    job = queued()
    relabel = Relabel(job)
    events = relabel.events(upstream_stream())
    assert [e["type"] for e in events] == ["response.in_progress", "response.output_text.delta",
                                           "response.completed"]
    assert all("sequence_number" not in e for e in events)
    final = events[-1]["response"]
    assert (final["id"], final["background"], final["created_at"], final["output"]) == (
        job["id"], True, 100, [{"type": "message", "id": "msg_1"}])
    assert relabel.upstream_id == "resp_up" and relabel.finished


def test_an_upstream_error_event_fails_the_job_with_its_message():
    relabel = Relabel(queued())
    events = relabel.events([{"type": "error", "error": {"code": "server_error", "message": "boom"}}])
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}


def test_a_job_read_off_its_log_and_numbered_alike_for_every_reader():
    job = queued()
    head = Entry([{"type": "response.created", "response": job}, {"type": "response.queued", "response": job}],
                 head={"response": job, "stream": True})
    body = Entry(Relabel(job).events(upstream_stream()), upstream_id="resp_up")
    log = {0: Entry.decode(head.encode()), 1: Entry.decode(body.encode())}
    read = jobs.view(log, 2)
    assert (read.outcome, read.upstream_id, read.response["status"]) == ("completed", "resp_up", "completed")
    served = list(jobs.numbered(log.values()))
    assert [e["sequence_number"] for e, _ in served] == [0, 1, 2, 3, 4]
    assert [last for _, last in served] == [False] * 4 + [True]
    assert jobs.view({0: head}, 1).response["status"] == "queued"


def test_the_first_end_in_the_log_wins():
    job = queued()
    head = Entry([], head={"response": job, "stream": False})
    done = Entry([{"type": "response.completed", "response": {**job, "status": "completed"}}])
    assert jobs.view({0: head, 1: Entry(cancelled=True), 2: done}, 3).response["status"] == "cancelled"
    assert jobs.view({0: head, 1: done, 2: Entry(cancelled=True)}, 3).outcome == "completed"
    failed = Entry([jobs.failed_event(job, "gone")])
    assert jobs.view({0: head, 1: failed, 2: done}, 3).response["error"]["message"] == "gone"


def test_server_sent_events_across_chunks():
    reader = SSEReader()
    assert reader.feed(b'event: a\ndata: {"type": "a"') == []
    assert reader.feed(b'}\n\nevent: b\r\ndata: {"type": "b"}\r\n\r\n') == [{"type": "a"}, {"type": "b"}]


def test_a_run_is_the_request_in_the_foreground_streamed():
    assert jobs.run_body({"model": "m", "background": True, "background_options": {}, "stream": False}) == {
        "model": "m", "stream": True}
