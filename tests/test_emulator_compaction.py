"""The emulator's compaction follows the API (docs/emulator.md#compaction):
/responses/compact in the spec's shape, opaque items bound to the server and
the credential, the trigger last, context_management; and servers without it."""

from __future__ import annotations

import json

import openresponses_types as spec
import pytest
from driver import httpx


def call(emulator, body: dict, path: str = "/v1/responses", key: str = "sk-a") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as c:
        return c.post(emulator.url + path, json=body, headers={"authorization": f"Bearer {key}"})


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_compact_answers_the_spec_shape_and_its_item_is_read_back(emulator):
    r = call(emulator, {"model": "m", "input": [user("a"), {"role": "assistant", "content": "b"}, user("c")],
                        "tools": [], "reasoning": {"effort": "low"}}, "/v1/responses/compact")
    assert r.status_code == 200, r.text
    compacted = spec.CompactResource.model_validate(r.json())
    assert compacted.object == "response.compaction"
    assert [o.type for o in compacted.output] == ["message", "message", "compaction"]
    item = r.json()["output"][-1]
    follow = call(emulator, {"model": "m", "input": [*r.json()["output"][:-1], item, user("d")]})
    assert follow.status_code == 200, follow.text
    other = call(emulator, {"model": "m", "input": [item, user("d")]}, key="sk-b")
    assert other.status_code == 400 and other.json()["error"]["code"] == "invalid_encrypted_content"


def test_compact_reads_a_stored_chain(emulator):
    first = call(emulator, {"model": "m", "input": "one"}).json()
    r = call(emulator, {"model": "m", "previous_response_id": first["id"]}, "/v1/responses/compact")
    assert r.status_code == 200 and len(emulator.model.snapshot_log()[-1]["context"]) == 2


def test_the_trigger_must_be_last_and_answers_one_compaction_item(emulator):
    trigger = {"type": "compaction_trigger"}
    r = call(emulator, {"model": "m", "input": [trigger, user("a")]})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "The 'compaction_trigger' item must be the final input item."
    r = call(emulator, {"model": "m", "input": [user("a"), {**trigger, "id": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    r = call(emulator, {"model": "m", "input": [user("a"), trigger], "stream": True, "store": False})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["compaction"] and events[-1]["type"] == "response.completed"
    assert trigger not in emulator.model.snapshot_log()[-1]["context"]


def test_context_management_compacts_past_its_threshold(emulator):
    managed = {"model": "m", "input": [user("x" * 400)],
               "context_management": [{"type": "compaction", "compact_threshold": 50}]}
    assert [o["type"] for o in call(emulator, managed).json()["output"]] == ["compaction", "message"]
    managed["context_management"][0]["compact_threshold"] = 100000
    assert [o["type"] for o in call(emulator, managed).json()["output"]] == ["message"]


@pytest.mark.parametrize("mode, status", [("absent", 404), ("not_allowed", 405), ("ignore", 404)])
def test_a_server_without_compaction(emulator, mode, status):
    item = call(emulator, {"model": "m", "input": [user("a")]}, "/v1/responses/compact").json()["output"][-1]
    emulator.model.control({"compaction": mode})
    assert call(emulator, {"model": "m", "input": [user("a")]}, "/v1/responses/compact").status_code == status
    refused = call(emulator, {"model": "m", "input": [item, user("b")]})
    assert refused.status_code == 400 and "item type 'compaction' is not supported" in refused.text
    triggered = call(emulator, {"model": "m", "input": [user("a"), {"type": "compaction_trigger"}]})
    if mode == "ignore":
        assert [o["type"] for o in triggered.json()["output"]] == ["message"]
    else:
        assert triggered.status_code == 400 and "Invalid input type 'compaction_trigger'" in triggered.text
