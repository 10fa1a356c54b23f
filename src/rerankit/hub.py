"""Hub ids without a network: the local cache is read first, and an id that is not there fails at once.

It imports neither torch nor transformers, so ``make_backend`` checks a hub id before the engine loads.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from rerankit.errors import ModelLoadError

# a cache holding the config and one of these is taken as the whole model (a sharded one's index names its shards)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
HUB_CHECK_SECONDS = 1.0  # how long a hub id not in the local cache waits to learn whether the hub can be reached


def names_a_folder(model: str) -> bool:
    """Whether ``model`` can only be a folder, not a hub id (``org/name`` or ``name``): it starts with ``.``, ``/``
    or ``~``, or has more than one ``/``."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1


def check_source(model: str) -> bool:
    """For a ``model`` that is not an existing folder: ``ModelLoadError`` at once where it can only be a folder
    ("no model folder at ...") or is a hub id neither cached nor reachable (``hub_cached``); else whether the hub
    id is cached (True: it loads with no network call)."""
    if names_a_folder(model):
        raise ModelLoadError(f"no model folder at {model!r}")
    return hub_cached(model)


def hub_cached(model: str) -> bool:
    """Whether hub id ``model``'s config and weights are in the local cache (it then loads with no network call);
    ``ModelLoadError`` at once, in one line, when they are not and the hub cannot be reached (``HF_HUB_OFFLINE``
    set, or no connection within ``HUB_CHECK_SECONDS``), instead of huggingface_hub's retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = [isinstance(try_to_load_from_cache(model, name), str) for name in ("config.json", *WEIGHT_FILES)]
    except ValueError as exc:  # HFValidationError: not a hub id ("org/name") either
        raise ModelLoadError(f"no model folder at {model!r}, and it is not a hub id: {exc}") from None
    if cached[0] and any(cached[1:]):
        return True
    how = ("is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
           else None if _hub_reachable(constants.ENDPOINT) else
           "is not in the local Hugging Face cache and the hub cannot be reached")
    if how is not None:
        raise ModelLoadError(f"{model!r} {how}: pass the model's folder instead (e.g. after `hf download {model} "
                             "--local-dir DIR` on a machine with a network), or point HF_HOME at a cache holding it")
    return False


def _hub_reachable(endpoint: str) -> bool:
    """A TCP connection to the hub (or a configured proxy) within ``HUB_CHECK_SECONDS``, name lookup included; a
    refused connection or a failed lookup answers at once."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    address = urlsplit(proxy if proxy else endpoint)
    port = address.port or (443 if address.scheme == "https" else 80)
    reached, done = threading.Event(), threading.Event()

    def connect() -> None:
        try:
            socket.create_connection((address.hostname, port), timeout=HUB_CHECK_SECONDS).close()
            reached.set()
        except OSError:
            pass
        finally:
            done.set()

    # a thread, because the name lookup inside create_connection is not bounded by its timeout
    threading.Thread(target=connect, daemon=True, name="rerankit-hub-check").start()
    done.wait(HUB_CHECK_SECONDS)
    return reached.is_set()
