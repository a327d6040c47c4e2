"""The addons, in hook order, sharing one planner (mitmproxy's own idiom: many
small addons in one list, see ``mitmproxy/addons/__init__.py``)."""

from __future__ import annotations

from .emulation import StoreEmulation
from .forward import ForwardMode
from .glue import Replays
from .options import Options
from .planner import Planner
from .recorder import Recorder
from .statestore import StateStore


def make_addons() -> list:
    planner = Planner()
    recorder = Recorder(ttl=planner.ttl)
    state = StateStore(planner, recorder)
    replays = Replays(planner.counters)
    return [
        Options(planner, recorder),  # first: parses every option before the others configure
        state,
        StoreEmulation(planner, state, recorder, replays),  # before forward mode: it plans the expanded body
        ForwardMode(planner, state, replays),
        replays,  # last: its collector wraps the others' taps
    ]
