# Sourced by the scripts: make sure a virtual environment with everything
# installed exists, then put it first on PATH.
#   VENV      where it lives (default: .venv in the repository)
#   PYTHON    the interpreter that creates it (default: python3)
#   MITMPROXY a pip requirement for mitmproxy (default: mitmproxy>=11)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
MITMPROXY="${MITMPROXY:-mitmproxy>=11}"
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)-$(echo "$MITMPROXY" | cksum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ]; then
    echo "setting up $VENV with $("$PYTHON" --version 2>&1) and $MITMPROXY" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
    # mitmproxy is pinned first and on its own: resolving it together with the
    # openai SDK can backtrack to an old mitmproxy that fails to build (FACTS.md).
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$MITMPROXY" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]" "$MITMPROXY" 2>&1 \
        | grep -v -e "^WARNING: Location" -e "dependency conflicts" -e "h11" >&2 || true
    "$VENV/bin/python" -c "import mitmproxy, blake3, pytest, hypothesis, openai" \
        || { echo "installation into $VENV failed" >&2; exit 1; }
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
