"""Every addon of ours, in hook order (mitmproxy's own idiom: many small
addons in one list, see ``mitmproxy/addons/__init__.py``), each handed the
shared pieces it uses: the settings in force, tenant identity, what is known
of each upstream, the request reader, the counters and the state store."""

from __future__ import annotations

from .compaction.addon import Compaction
from .counters import Counters
from .forward.addon import ForwardMode
from .background.addon import Background
from .background.jobs import Jobs
from .continuation.planner import Planner
from .heap import FrozenStartupHeap
from .logs import quiet_libraries
from .options import Options
from .proofs import Proofs
from .request_reader import Reader
from .record.addon import ContinuationRecord
from .record.index import ChainIndex
from .replays import Replays
from .request_encoding.addon import DecodedRequests
from .router.addon import Router
from .settings import Config
from .state.addon import StateStore
from .store_emulation.addon import ConversationEmulation, StoreEmulation
from .store_emulation.conversations import Conversations
from .store_emulation.history import History
from .telemetry.addon import Telemetry
from .tenancy import Tenancy
from .upstreams import Upstreams
from .view import ContentView
from .websocket.addon import WebSocketBridge
from .client_websocket.addon import ClientWebSocket


def make_addons() -> list:
    quiet_libraries()  # before any of them logs: mitmproxy lets every level through
    config, counters, tenancy = Config(), Counters(), Tenancy()
    upstreams = Upstreams(config, tenancy)
    reader = Reader(config, counters, tenancy)
    planner = Planner(config, counters, tenancy, upstreams, reader)
    history = History(config)
    conversations = Conversations(config)
    index = ChainIndex(config)
    jobs = Jobs(config)
    state = StateStore(config, tenancy, upstreams, planner, history, conversations, index, jobs)
    background = Background(config, counters, tenancy, upstreams, state, jobs)
    replays = Replays(counters)
    proofs = Proofs(upstreams, replays, state, counters)
    record = ContinuationRecord(config, counters, tenancy, reader, state, index)
    emulation = StoreEmulation(config, counters, tenancy, reader, upstreams, state, history, replays, proofs)
    conversation_emulation = ConversationEmulation(config, counters, tenancy, reader, upstreams, state, history,
                                                   conversations, proofs, emulation)
    router = Router(config, counters, index, replays, conversation_emulation.full_history)
    forward = ForwardMode(planner, state, replays, proofs)
    decoding = DecodedRequests(config, counters)
    bridge = WebSocketBridge(config, counters, tenancy, reader, upstreams, state, replays, planner, proofs)
    telemetry = Telemetry(config, counters, lambda: (len(bridge.pool), bridge.pool.events))
    record.listeners.append(telemetry.call)  # a span per call the record finishes
    state.observer = telemetry.store_operation  # every backend call timed
    return [
        Options(config),  # first: parses every option before the others configure
        telemetry.start,  # before every capability: a request's time on the proxy starts here
        state,
        decoding,  # before every capability: a compressed request body is read plain
        background,  # before the others plan: a background create it runs is answered, its job replayed through them
        record,  # lifts the client's own request, before any change
        router,  # picks the upstream the emulations, the bridge and forward mode plan for
        # before store and conversation emulation: what replaces a checked continuation's answer is what they record
        forward.checks,
        conversation_emulation,  # before store emulation: it records the expanded body
        emulation,  # before forward mode: it plans the expanded body
        # after the emulations (their expansions may hold its items), before the bridge and forward mode (they send
        # the summaries in the items' place)
        Compaction(config, counters, tenancy, reader, upstreams, state, replays, emulation.compact_history),
        # before forward mode: a flow it takes is answered over an upstream WebSocket, never rewritten
        bridge,
        forward,
        decoding.encoded,  # after every change to a request: it goes upstream encoded as the client's
        router.answers,  # fails over after the ones above learned from the failed answer
        record.answers,  # records what the client got, after every change
        background.answers,  # late: its tap of a job's answer wraps every other tap
        # after every addon that taps or replaces an answer: a socket turn's client gets what HTTP's would
        ClientWebSocket(config, counters, tenancy, upstreams, state),
        telemetry,  # counts what the flow's metadata says the others did, once all of them are done
        ContentView(),  # the Stateful Responses view of every capability's flows, in mitmweb
        replays,  # last: its collector wraps the others' taps
        FrozenStartupHeap(),
    ]
