"""The Hugging Face hub: is it switched off, can it be reached, and offline mode.

Everything that may download (hub datasets for `data prepare`, HF teachers for distillation,
lm-eval task datasets) asks here first, so that an unreachable hub costs a few seconds and one
clear line instead of a retry loop.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Optional
from urllib.parse import urlsplit

from ropelab.errors import one_line

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_variable() -> Optional[str]:
    """The variable that switches the hub off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set true), or None."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def address() -> tuple[str, int]:
    """(host, port) a hub request connects to first: the HTTPS proxy if one is set, else ``$HF_ENDPOINT``
    (default huggingface.co)."""
    proxy = next((os.environ[name] for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(name)), None)
    if proxy:
        target = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    else:
        target = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return target.hostname or "", target.port or (443 if target.scheme == "https" else 80)


def unreachable_reason(timeout: float = 3.0) -> Optional[str]:
    """None if a TCP connection to the hub (`address`) opens within `timeout` seconds, DNS included;
    else why not, in a few words. A thread bounds the wait: a DNS lookup ignores socket timeouts."""
    host, port = address()
    if not host:
        return "no host in HF_ENDPOINT or the proxy variable"
    outcome: list[Optional[str]] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(getattr(exc, "strerror", None) or one_line(exc))

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def reachable(timeout: float = 3.0) -> bool:
    return unreachable_reason(timeout) is None


def set_offline() -> None:
    """Hub and datasets offline mode, also for modules that read the variables at import."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
        config.HF_DATASETS_OFFLINE = True


def offline_unless_reachable(timeout: float = 3.0) -> bool:
    """Switch to offline mode when the hub cannot be reached, so that cached files load and others
    fail at once. True when offline (already, or now)."""
    if offline_variable() is not None:
        return True
    if reachable(timeout):
        return False
    set_offline()
    return True
