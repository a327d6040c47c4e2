"""A real LiteLLM proxy for tests, a gateway in front of the emulator: 127.0.0.1
on a free port, no database, a master key (it refuses to start without one),
stopped at teardown. It runs from a venv of its own (scripts/install-litellm),
never the project's: its pins would fight the project's openai SDK and mitmproxy.

Its model names, one per route of ``/v1/responses``:
- ``native``: ``openai/<m>``, passed through to the emulator's ``/responses``;
- ``chat-bridge``: ``openai/chat_completions/<m>``, bridged onto the emulator's
  chat completions;
- ``provider-bridge``: ``custom_openai/<m>``, a provider without a Responses API,
  which LiteLLM bridges onto chat completions too."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from harness import ROOT, LoopbackServer

REQUIREMENTS = ROOT / "tests" / "litellm-requirements.txt"
VERSION = re.search(r"^litellm\[proxy\]==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE).group(1)
VENV = Path(os.environ.get("LITELLM_VENV") or ROOT / ".venv-litellm")
MASTER_KEY = "sk-litellm-gateway-tests"
UPSTREAM_MODEL = "emulated"  # the model name the emulator sees on every route
STARTUP_TIMEOUT = 120  # it imports for about 12 s on an idle machine
# Local copies instead of fetches at startup (the model cost map, Anthropic's beta
# headers, blog posts, policy templates, router presets): loopback only. Telemetry
# is off unless configured.
OFFLINE = {name: "True" for name in (
    "LITELLM_LOCAL_MODEL_COST_MAP", "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "LITELLM_LOCAL_BLOG_POSTS",
    "LITELLM_LOCAL_POLICY_TEMPLATES", "LITELLM_LOCAL_AUTOROUTER_PRESETS",
)}


def litellm_binary() -> Path:
    """LiteLLM's command in its venv. Skips when the venv is absent; a venv
    without the pinned release is a broken install, a failure."""
    if not VENV.exists():
        pytest.skip(f"LiteLLM's venv {VENV} is absent: scripts/install-litellm makes it (scripts/test runs it)")
    binary = VENV / "bin" / "litellm"
    if not binary.exists() or not list(VENV.glob(f"lib/python*/site-packages/litellm-{VERSION}.dist-info")):
        pytest.fail(f"{VENV} has no LiteLLM {VERSION}: run scripts/install-litellm again")
    return binary


def gateway_environment() -> dict[str, str]:
    """The tests' environment without anything that would give LiteLLM a
    database or settings of its own, plus the offline switches."""
    inherited = {name: value for name, value in os.environ.items()
                 if not name.startswith(("LITELLM_", "DATABASE_", "OPENAI_")) and name != "DIRECT_URL"}
    return {**inherited, **OFFLINE, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class LiteLLMGateway(LoopbackServer):
    name = "litellm"
    native_model = "native"
    chat_bridge_model = "chat-bridge"
    provider_bridge_model = "provider-bridge"
    master_key = MASTER_KEY

    @property
    def base_url(self) -> str:
        """What a client's ``base_url`` is set to."""
        return f"{self.url}/v1"

    def config(self) -> dict:
        api = {"api_base": f"{self.upstream}/v1", "api_key": "sk-emulator"}
        routes = {
            self.native_model: f"openai/{UPSTREAM_MODEL}",
            self.chat_bridge_model: f"openai/chat_completions/{UPSTREAM_MODEL}",
            self.provider_bridge_model: f"custom_openai/{UPSTREAM_MODEL}",
        }
        return {
            "model_list": [{"model_name": name, "litellm_params": {"model": model, **api}}
                           for name, model in routes.items()],
            "litellm_settings": {"drop_params": True},
            "general_settings": {"master_key": self.master_key},
        }

    def start(self) -> None:
        config = self.directory / "config.yaml"
        config.write_text(json.dumps(self.config(), indent=2))  # JSON is YAML
        self.launch([str(litellm_binary()), "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port)],
                    gateway_environment(), STARTUP_TIMEOUT)


def start_litellm_gateway(upstream: str, directory: Path) -> LiteLLMGateway:
    gateway = LiteLLMGateway(upstream, directory)
    gateway.start()
    return gateway


@pytest.fixture(scope="module")
def litellm_gateway(emulator, tmp_path_factory):
    """LiteLLM's proxy with the emulator behind each of its routes, one per
    test module (it takes about 12 s to start): a module using it makes its
    ``emulator`` module-scoped too (``module_emulator`` below)."""
    gateway = start_litellm_gateway(emulator.url, tmp_path_factory.mktemp("litellm"))
    yield gateway
    gateway.stop()


def module_emulator():
    """The ``emulator`` fixture of a test module that runs LiteLLM: one per
    module, reset before each test (``fresh_emulator``)."""
    from stateful_responses.emulator import Emulator

    @pytest.fixture(scope="module")
    def emulator():
        with Emulator() as emu:
            yield emu

    return emulator


@pytest.fixture
def fresh_emulator(emulator):
    """An empty log and store, and no faults, for each test."""
    emulator.model.control({"reset": True})
    return emulator
