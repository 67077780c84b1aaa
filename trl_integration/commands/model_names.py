"""A model name answered before anything loads: a folder, an alias, or a Hub id this machine can have.

transformers resolves a ``--model_name_or_path`` that is not a folder on the Hugging Face Hub. On a machine without
network it retried five times (74 s measured for ``safevocab-grpo --model smollm2``, a typo of the alias
``smollm2-135m``) and ended with "check your internet connection", never naming what the user meant. Here, in the
command's early checks (no torch, no transformers imported):

- a local folder, or an alias of :data:`~trl_integration.demo.model_alias.MODEL_ALIASES`: accepted;
- a Hub id whose ``config.json`` is in the local Hugging Face cache: accepted (it loads offline);
- otherwise, when the Hub cannot be reached (``HF_HUB_OFFLINE`` set, or no connection to the Hub's host within
  :data:`CONNECT_TIMEOUT_S`): refused in one line naming the flag, with the closest alias ("did you mean
  ``smollm2-135m``?") when one is close. The process is then marked offline (``HF_HUB_OFFLINE=1``), so that nothing
  later retries the Hub either;
- a Hub id while the Hub is reachable: accepted (the Hub answers).
"""

from __future__ import annotations

import difflib
import os
import socket
from urllib.parse import urlparse

__all__ = ["CONNECT_TIMEOUT_S", "hub_reachable", "in_hub_cache", "closest_alias", "check_model_name"]

#: Seconds to wait for a connection to the Hub's host before calling it unreachable.
CONNECT_TIMEOUT_S = 2.0

_TRUE = ("1", "true", "yes", "on")


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the Hugging Face Hub can be reached: not ``HF_HUB_OFFLINE``, and a TCP connection to its host
    (``HF_ENDPOINT``, default huggingface.co) opens within ``timeout`` seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def in_hub_cache(repo_id: str) -> bool:
    """Whether the Hub model ``repo_id`` has its ``config.json`` in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return False
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a name the cache cannot even look up is not in it
        return False


def closest_alias(name: str, aliases) -> str | None:
    """The alias closest to ``name`` (``difflib``; a prefix of an alias counts as close), or ``None``."""
    lowered = name.lower()
    prefixed = [alias for alias in aliases if alias.startswith(lowered) or lowered.startswith(alias)]
    if prefixed:
        return prefixed[0]
    close = difflib.get_close_matches(lowered, list(aliases), n=1, cutoff=0.6)
    return close[0] if close else None


def check_model_name(name: str, flag: str = "--model_name_or_path") -> None:
    """Refuse, in one line naming ``flag``, a model this machine cannot have (the module docstring).

    Raises:
        ValueError: ``name`` is not a folder, not an alias, not in the Hub cache, and the Hub cannot be reached.
    """
    from trl_integration.demo.model_alias import MODEL_ALIASES

    if name in MODEL_ALIASES or os.path.isdir(os.path.expanduser(name)) or in_hub_cache(name):
        return
    if hub_reachable():
        return
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing later in this process retries the Hub
    guess = closest_alias(name, MODEL_ALIASES)
    hint = f"did you mean --model {guess}? " if guess else ""
    raise ValueError(
        f"{flag} {name}: not a model folder, not an alias and not in the Hugging Face cache, and the Hub cannot be "
        f"reached from here: {hint}accepted an alias ({', '.join(MODEL_ALIASES)}), a local folder saved with "
        "save_pretrained, or a Hub id already downloaded"
    )
