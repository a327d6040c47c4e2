"""Regular-proxy mode for tools that cannot be reconfigured: the client reaches an
HTTPS upstream through mitmproxy as its HTTPS_PROXY, trusting mitmproxy's CA,
configured by environment variables alone."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from stateful_responses.emulator import Emulator

CLIENT = textwrap.dedent("""
    import json, sys, openai
    client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-tls", max_retries=0)  # env decides the rest
    history = []
    for n in range(5):
        history.append({"role": "user", "content": f"tls turn {n}"})
        history += [o.model_dump(exclude_none=True) for o in client.responses.create(model="gpt-test", input=history).output]
    print(json.dumps(history))
""")


def self_signed(tmp: Path, dns_name: str | None = None) -> tuple[str, str]:
    """A CA certificate for 127.0.0.1 (or, given ``dns_name``, for that name alone) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "emulator.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name) if dns_name else
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "emulator.pem", tmp / "emulator.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_https_through_a_regular_proxy_still_continues(tmp_path, start_proxy):
    cert, key = self_signed(tmp_path)
    with Emulator(certfile=cert, keyfile=key) as emu:
        proxy = start_proxy(emu.url, "--set", f"ssl_verify_upstream_trusted_ca={cert}", mode="regular")
        env = {**os.environ, "HTTPS_PROXY": proxy.url, "https_proxy": proxy.url, "NO_PROXY": "", "no_proxy": "",
               "SSL_CERT_FILE": str(Path(proxy.confdir) / "mitmproxy-ca-cert.pem")}
        result = subprocess.run([sys.executable, "-c", CLIENT, emu.url + "/v1"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        log = emu.model.snapshot_log()
    assert len(log) == 5
    assert [r["continued"] for r in log] == [False, True, True, True, True]
    history = json.loads(result.stdout)
    # the last request's effective context is the client's whole input
    assert log[-1]["context"] == history[:-1]
