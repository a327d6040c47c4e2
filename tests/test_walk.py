"""The chain walk (seed 000): order, guards and their order, the API's errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stateful_responses.store_emulation.walk import ChainError, Link, walk


def getter(links: dict[str, tuple[str | None, str]]):
    async def get(response_id: str):
        if response_id not in links:
            return None
        parent, status = links[response_id]
        return Link(response_id, parent, status, response_id)
    return get


async def test_the_chain_comes_back_oldest_first():
    links = {"r3": ("r2", "completed"), "r2": ("r1", "completed"), "r1": (None, "completed")}
    assert await walk(getter(links), "r3", 10) == ["r1", "r2", "r3"]


@pytest.mark.parametrize(
    ("links", "start", "depth", "code"),
    [
        ({}, "r1", 10, "previous_response_not_found"),
        ({"r2": ("r1", "completed")}, "r2", 10, "previous_response_not_found"),
        ({"r1": ("r2", "completed"), "r2": ("r1", "completed")}, "r1", 10, "session_chain_cycle_detected"),
        ({"r1": ("r1", "completed")}, "r1", 10, "session_chain_cycle_detected"),
        ({"r3": ("r2", "completed"), "r2": ("r1", "completed"), "r1": (None, "completed")}, "r3", 2,
         "session_chain_depth_exceeded"),
        ({"r2": ("r1", "completed"), "r1": (None, "incomplete")}, "r2", 10, "session_chain_unavailable"),
        # the seed's order: depth before cycle before missing before status
        ({"r2": ("r1", "completed")}, "r2", 1, "session_chain_depth_exceeded"),
        ({"r1": ("r2", "completed"), "r2": ("r1", "failed")}, "r1", 10, "session_chain_unavailable"),
    ],
    ids=["missing", "missing-ancestor", "cycle", "self-cycle", "too-deep", "incomplete", "depth-first",
         "status-before-cycle-when-reached-first"],
)
async def test_guards_raise_the_apis_errors_naming_the_ids(links, start, depth, code):
    with pytest.raises(ChainError) as caught:
        await walk(getter(links), start, depth)
    assert caught.value.code == code
    assert caught.value.body["error"]["param"] == "previous_response_id"
    assert start in str(caught.value)


async def test_a_missing_first_response_has_the_apis_exact_body():
    with pytest.raises(ChainError) as caught:
        await walk(getter({}), "resp_x", 10)
    assert caught.value.body == {"error": {"message": "Previous response with id 'resp_x' not found.",
                                           "type": "invalid_request_error", "param": "previous_response_id",
                                           "code": "previous_response_not_found"}}


@given(st.integers(1, 60), st.integers(1, 60))
async def test_exactly_max_depth_turns_are_allowed(length, max_depth):
    links = {f"r{n}": (f"r{n - 1}" if n else None, "completed") for n in range(length)}
    try:
        turns = await walk(getter(links), f"r{length - 1}", max_depth)
    except ChainError as e:
        assert e.code == "session_chain_depth_exceeded" and length > max_depth
    else:
        assert length <= max_depth and turns == [f"r{n}" for n in range(length)]
