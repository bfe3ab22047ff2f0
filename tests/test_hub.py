"""ropelab.hub: offline switches, the address a hub request connects to, the reachability probe,
and offline mode (environment and already-imported modules)."""

from __future__ import annotations

import socket
import sys

import pytest

from ropelab import hub

PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture
def clean_env(monkeypatch):
    """No offline switch, no proxy, no endpoint; offline mode set by a test is undone afterwards."""
    for name in (*hub.OFFLINE_VARIABLES, *PROXIES, "HF_ENDPOINT"):
        monkeypatch.setenv(name, "")  # records the value to restore, even when unset (delenv alone would not)
        monkeypatch.delenv(name)
    for module, names in (("huggingface_hub.constants", ["HF_HUB_OFFLINE"]),
                          ("datasets.config", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])):
        if module in sys.modules:
            for name in names:
                monkeypatch.setattr(sys.modules[module], name, getattr(sys.modules[module], name))
    return monkeypatch


@pytest.fixture
def listener():
    """A local TCP port that accepts connections."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


def test_offline_variable(clean_env):
    assert hub.offline_variable() is None
    clean_env.setenv("HF_DATASETS_OFFLINE", "0")
    assert hub.offline_variable() is None
    clean_env.setenv("HF_DATASETS_OFFLINE", " True ")
    assert hub.offline_variable() == "HF_DATASETS_OFFLINE"


def test_address_prefers_the_proxy(clean_env):
    assert hub.address() == ("huggingface.co", 443)
    clean_env.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    assert hub.address() == ("mirror.example", 8080)
    clean_env.setenv("all_proxy", "proxy.example:3128")  # no scheme: host:port still parses
    assert hub.address() == ("proxy.example", 3128)
    clean_env.setenv("HTTPS_PROXY", "http://first.example")
    assert hub.address() == ("first.example", 80)


def test_probe_tells_an_open_port_from_a_closed_one(clean_env, listener):
    clean_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener}")
    assert hub.unreachable_reason(timeout=2.0) is None and hub.reachable(timeout=2.0)
    clean_env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    reason = hub.unreachable_reason(timeout=2.0)
    assert reason and "\n" not in reason and not hub.reachable(timeout=2.0)


def test_offline_unless_reachable(clean_env, listener):
    clean_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener}")
    assert hub.offline_unless_reachable(timeout=2.0) is False and hub.offline_variable() is None
    clean_env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert hub.offline_unless_reachable(timeout=2.0) is True
    assert hub.offline_variable() == "HF_HUB_OFFLINE"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # a module that read the variable at import is switched too
        assert constants.HF_HUB_OFFLINE is True
    clean_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener}")
    assert hub.offline_unless_reachable(timeout=2.0) is True  # offline stays offline
