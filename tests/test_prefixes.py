"""The prefix store: deepest strict prefix, branches, bounds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from stateful_responses.continuation.prefixes import PrefixStore

NOW, FOREVER = 1000.0, float("inf")


def d(*parts: int) -> bytes:
    return bytes(parts)


def test_deepest_needs_at_least_one_new_item():
    store = PrefixStore(4)
    store.remember(d(1, 2), 2, "resp_a", None, "u", FOREVER)
    assert store.deepest([d(1), d(1, 2)], NOW) is None  # same sequence: nothing new to send
    match = store.deepest([d(1), d(1, 2), d(1, 2, 3)], NOW)
    assert (match.response_id, match.length) == ("resp_a", 2)


def test_deepest_prefers_the_longest_stored_prefix():
    store = PrefixStore(4)
    store.remember(d(1), 1, "resp_short", None, "u", FOREVER)
    store.remember(d(1, 2, 3), 3, "resp_long", d(1), "u", FOREVER)
    assert store.deepest([d(1), d(1, 2), d(1, 2, 3), d(1, 2, 3, 4)], NOW).response_id == "resp_long"
    assert store.deepest([d(1), d(1, 2), d(1, 2, 9)], NOW).response_id == "resp_short"


def test_advancing_a_tip_keeps_one_branch_and_forking_starts_another():
    store = PrefixStore(8)
    store.remember(d(1), 1, "r1", None, "u", FOREVER)
    store.remember(d(2), 2, "r2", d(1), "u", FOREVER)
    assert store.branch_count == 1
    store.remember(d(3), 2, "r3", d(1), "u", FOREVER)  # d(1) is no longer a tip: a fork
    assert store.branch_count == 2


def test_branches_are_evicted_least_recently_used():
    store = PrefixStore(2)
    store.remember(d(1), 1, "r1", None, "u", FOREVER)
    store.remember(d(2), 1, "r2", None, "u", FOREVER)
    store.deepest([d(1), d(1, 0)], NOW)  # touch branch 1
    store.remember(d(3), 1, "r3", None, "u", FOREVER)
    assert store.deepest([d(2), d(2, 0)], NOW) is None
    assert store.deepest([d(1), d(1, 0)], NOW).response_id == "r1"
    assert store.branch_count == 2


def test_a_branch_keeps_only_its_newest_entries():
    store = PrefixStore(1, max_entries_per_branch=3)
    parent = None
    for n in range(10):
        store.remember(d(n), n + 1, f"r{n}", parent, "u", FOREVER)
        parent = d(n)
    assert len(store) == 3 and store.branch_count == 1
    assert store.deepest([d(9), d(9, 0)], NOW).response_id == "r9"
    assert store.deepest([d(0), d(0, 0)], NOW) is None


def test_forget_and_forget_scope():
    store = PrefixStore(8)
    store.remember(d(1), 1, "r1", None, "a", FOREVER)
    store.remember(d(2), 2, "r2", d(1), "a", FOREVER)
    store.remember(d(3), 1, "r3", None, "b", FOREVER)
    assert store.forget(d(2)) and not store.forget(d(2))
    assert store.deepest([d(1), d(1, 0)], NOW).response_id == "r1"
    assert store.forget_scope("a") == 1
    assert store.deepest([d(1), d(1, 0)], NOW) is None and len(store) == 1


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30) | st.none()), max_size=200),
       st.integers(1, 5), st.integers(1, 4))
def test_bounds_hold_whatever_the_traffic(ops, max_branches, per_branch):
    store = PrefixStore(max_branches, per_branch)
    for key, parent in ops:
        store.remember(d(key), 1, f"r{key}", None if parent is None else d(parent), "u", FOREVER)
        assert store.branch_count <= max_branches
        assert len(store) <= max_branches * per_branch


def test_expired_entries_are_never_matched():
    store = PrefixStore(4)
    store.remember(d(1), 1, "r_old", None, "u", NOW + 10)
    assert store.deepest([d(1), d(1, 0)], NOW).response_id == "r_old"
    assert store.deepest([d(1), d(1, 0)], NOW + 10) is None
    assert len(store) == 0
