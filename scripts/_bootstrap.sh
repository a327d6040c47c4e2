# Sourced by the scripts: make sure a virtual environment with everything
# installed exists, then put it first on PATH.
#   VENV      where it lives (default: .venv in the repository)
#   PYTHON    the interpreter that creates it (default: python3)
#   MITMPROXY a pip requirement for mitmproxy (default: mitmproxy>=11)
#   WITH_LITELLM=1 also installs LiteLLM's proxy (scripts/install-litellm)
#   WITH_AGENTIC_API=1 also installs vLLM's agentic-api (scripts/install-agentic-api)
#   WITH_SMG=1 also installs SGLang's smg (scripts/install-smg)
#   WITH_VLLM=1 also installs vLLM itself (scripts/install-vllm)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
MITMPROXY="${MITMPROXY:-mitmproxy>=11}"
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)-$(echo "$MITMPROXY" | cksum | cut -d' ' -f1)"
pip_install() {
    # pip's exit status decides; its known-harmless chatter is filtered out.
    local log status=0
    log="$(mktemp)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1 || status=$?
    grep -v -e "^WARNING: Location" -e "dependency resolver does not" -e "h11" "$log" >&2 || true
    rm -f "$log"
    return "$status"
}
if [ ! -f "$STAMP" ]; then
    echo "setting up $VENV with $("$PYTHON" --version 2>&1) and $MITMPROXY" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    pip_install --upgrade pip
    # Three steps on purpose. mitmproxy alone first: resolving it together with
    # the openai SDK can backtrack to an old mitmproxy that fails to build.
    # Then the test tools alone: the newest SDKs want an h11 newer than
    # mitmproxy 11 pins; pip reports the conflict and mitmdump 11 runs fine
    # with it (verified), whereas one joint resolution would backtrack the
    # clients we test to old releases. Then the project itself, without deps.
    deps() {  # dependencies listed in pyproject.toml: "runtime" (without mitmproxy) or "test"
        "$VENV/bin/python" - "$ROOT/pyproject.toml" "$1" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = project["dependencies"] if sys.argv[2] == "runtime" else project["optional-dependencies"]["test"]
print(" ".join(d for d in deps if not d.startswith("mitmproxy")))
PY
    }
    # shellcheck disable=SC2046
    pip_install "$MITMPROXY" $(deps runtime)
    TEST_DEPS="$(deps test)"
    # shellcheck disable=SC2086
    pip_install $TEST_DEPS
    pip_install --no-deps -e "$ROOT"
    "$VENV/bin/python" -c "import mitmproxy, blake3, msgspec, pytest, hypothesis, openai, agents, langchain_openai" \
        || { echo "installation into $VENV failed" >&2; exit 1; }
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
# LiteLLM's proxy, for its gateway tests (scripts/test asks with WITH_LITELLM=1): a venv
# of its own, installed once. In CI a failed install fails the setup; elsewhere those
# tests are skipped.
if [ "${WITH_LITELLM:-}" = 1 ] && ! "$ROOT/scripts/install-litellm"; then
    [ "${CI:-}" = true ] && exit 1
    echo "LiteLLM could not be installed: tests/test_litellm_gateway.py will be skipped" >&2
fi
# vLLM's agentic-api, a stateful gateway for tests/test_agentic_api.py (WITH_AGENTIC_API=1): alike.
if [ "${WITH_AGENTIC_API:-}" = 1 ] && ! "$ROOT/scripts/install-agentic-api"; then
    [ "${CI:-}" = true ] && exit 1
    echo "agentic-api could not be installed: tests/test_agentic_api.py will be skipped" >&2
fi
# SGLang's Shepherd Model Gateway (smg), a stateful gateway for tests/test_smg.py (WITH_SMG=1): alike.
if [ "${WITH_SMG:-}" = 1 ] && ! "$ROOT/scripts/install-smg"; then
    [ "${CI:-}" = true ] && exit 1
    echo "smg could not be installed: tests/test_smg.py will be skipped" >&2
fi
# vLLM itself, the upstream of tests/test_vllm.py (WITH_VLLM=1): alike.
if [ "${WITH_VLLM:-}" = 1 ] && ! "$ROOT/scripts/install-vllm"; then
    [ "${CI:-}" = true ] && exit 1
    echo "vLLM could not be installed: tests/test_vllm.py will be skipped" >&2
fi
export PATH="$VENV/bin:$PATH"
