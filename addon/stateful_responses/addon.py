"""The addons, in hook order, sharing one planner (mitmproxy's own idiom: many
small addons in one list, see ``mitmproxy/addons/__init__.py``)."""

from __future__ import annotations

from .continuation import ChainIndex
from .emulation import StoreEmulation
from .forward import ForwardMode
from .glue import Replays
from .heap import FrozenStartupHeap
from .options import Options
from .planner import Planner
from .record import ContinuationRecord
from .recorder import Recorder
from .router import Router
from .statestore import StateStore


def make_addons() -> list:
    planner = Planner()
    recorder = Recorder(ttl=planner.ttl)
    index = ChainIndex(ttl=planner.ttl)
    state = StateStore(planner, recorder, index)
    replays = Replays(planner.counters)
    record = ContinuationRecord(planner, state, index)
    emulation = StoreEmulation(planner, state, recorder, replays)
    router = Router(planner, replays, emulation.full_history)
    return [
        Options(planner, recorder),  # first: parses every option before the others configure
        state,
        record,  # lifts the client's own request, before any change
        router,  # picks the upstream the next two plan for
        emulation,  # before forward mode: it plans the expanded body
        ForwardMode(planner, state, replays),
        router.answers,  # fails over after the two above learned from the failed answer
        record.answers,  # records what the client got, after every change
        replays,  # last: its collector wraps the others' taps
        FrozenStartupHeap(),
    ]
