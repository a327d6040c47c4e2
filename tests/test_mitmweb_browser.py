"""mitmweb with the addon, looked at in headless Chromium: the flow list and the
flow view show what the addon decided.

Needs Debian's ``chromium`` (``.ci/run`` installs it) and Playwright's Python
package driving that executable; no browser is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
from driver import Conversation, user_turns
from harness import ADDON, Proxy, free_port, mitmdump_binary

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = os.environ.get("STATEFUL_SCREENSHOT")  # where to save a picture for the README
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
TOKEN = "stateful-test-token"


@pytest.fixture(params=["off"])
def mitmweb(emulator, request):
    """mitmweb with the addon; ``stateful_upstream_websocket`` as the test's ``mitmweb`` parameter says."""
    confdir = tempfile.mkdtemp(prefix="mitmweb-")
    port, web_port = free_port(), free_port()
    binary = mitmdump_binary("mitmweb")
    args = [binary, "--mode", f"reverse:{emulator.url}", "--listen-host", "127.0.0.1", "--listen-port", str(port),
            "--web-host", "127.0.0.1", "--web-port", str(web_port), "--set", "web_open_browser=false",
            "--set", f"confdir={confdir}", "-s", str(ADDON), "--set", f"stateful_upstream_websocket={request.param}"]
    for column in ("icon", "path", "method", "status", "size", "time", "comment"):
        args += ["--set", f"web_columns={column}"]
    if "web_password" in subprocess.run([binary, "--options"], capture_output=True, text=True).stdout:
        args += ["--set", f"web_password={TOKEN}"]  # mitmweb 12 asks for a token
    proxy = Proxy(args, port, confdir, owns_confdir=True).ready()
    try:
        yield proxy, f"http://127.0.0.1:{web_port}/?token={TOKEN}"
    finally:
        proxy.stop()


def test_flow_list_and_view_show_the_decision(mitmweb):
    playwright = pytest.importorskip("playwright.sync_api")
    proxy, web_url = mitmweb
    conv = Conversation(proxy.url)
    for text in user_turns(4):
        conv.turn(text)
    conv.close()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(web_url)
            rows = page.locator(".flow-table tbody tr.has-request")
            # locator waits, not wait_for_function: mitmweb's CSP forbids the eval that needs
            rows.nth(len(conv.sent)).wait_for(timeout=20_000)  # the client's, and the proof's GET
            # the columns the options name come with the options, which may arrive after the flows
            page.locator(".flow-table td.col-comment", has_text="continued from resp_").first.wait_for(timeout=20_000)
            # the flow list: the addon's marks and comments tell continued from full
            table = page.locator(".flow-table").inner_text()
            assert "full: 1 items (no stored prefix)" in table
            assert table.count("continued from resp_") == len(conv.sent) - 1, table
            # ♻ on each continued flow, and on the usage proof's one comparison (the turn sent whole beside it)
            assert table.count("♻") == len(conv.sent) - 1 + table.count("comparison for ") and "➡" in table
            assert table.count("can the upstream read resp_") == 1  # one proof per upstream + credential
            # open the last (continued) flow; the request body is shown by the addon's view
            rows.nth(len(conv.sent)).click()
            page.get_by_text("Stateful Responses").first.wait_for(timeout=20_000)
            detail = page.locator(".flow-detail").inner_text()
            assert "decision: continue" in detail
            assert "--- client sent" in detail and "--- sent upstream" in detail
            assert "previous_response_id: resp_" in detail
            if SCREENSHOT:
                page.screenshot(path=SCREENSHOT)
        finally:
            browser.close()


@pytest.mark.parametrize("mitmweb", ["auto"], indirect=True)
def test_a_bridged_flow_shows_the_real_upstream_and_what_went_over_the_socket(mitmweb, emulator):
    playwright = pytest.importorskip("playwright.sync_api")
    proxy, web_url = mitmweb
    conv = Conversation(proxy.url, options={"store": False})
    for text in user_turns(3):
        conv.turn(text)
    conv.close()
    assert {r["transport"] for r in emulator.model.snapshot_log()} == {"websocket"}
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(web_url)
            rows = page.locator(".flow-table tbody tr.has-request")
            rows.nth(len(conv.sent) - 1).wait_for(timeout=20_000)
            # the columns the options name come with the options, which may arrive after the flows
            page.locator(".flow-table td.col-comment", has_text="ws: continued from resp_").first.wait_for(
                timeout=20_000)
            table = page.locator(".flow-table").inner_text()
            assert table.count("ws: continued from resp_") == len(conv.sent) - 1 and "ws: full: 1 items" in table
            assert f":{emulator.port}/v1/responses" in table and "stateful-websocket" not in table
            rows.nth(len(conv.sent) - 1).click()
            page.get_by_text("Stateful Responses").first.wait_for(timeout=20_000)
            detail = page.locator(".flow-detail").inner_text()
            assert "transport: the upstream's WebSocket, continue" in detail and '"store": false' in detail
        finally:
            browser.close()
