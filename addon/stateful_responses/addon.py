"""The addons, in hook order, sharing one planner (mitmproxy's own idiom: many
small addons in one list, see ``mitmproxy/addons/__init__.py``)."""

from __future__ import annotations

from .forward import ForwardMode
from .options import Options
from .planner import Planner
from .statestore import StateStore


def make_addons() -> list:
    planner = Planner()
    state = StateStore(planner)
    return [
        Options(planner),  # first: parses every option before the others configure
        state,
        ForwardMode(planner, state),
    ]
