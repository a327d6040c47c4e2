"""A faithful OpenAI Responses API emulator: the oracle for stateful-responses'
demo and tests. It never imports the addon."""

from .model import ResponsesModel, context_digest
from .server import Emulator
from .sse import sse_events

__all__ = ["Emulator", "ResponsesModel", "context_digest", "sse_events"]
