"""A model by name: a local directory, or a model id downloaded once into the standard cache.

    resolve_model("pretrained_models/CosyVoice2-0.5B")   # a directory: used as it is
    resolve_model("FunAudioLLM/CosyVoice2-0.5B")         # Hugging Face: ~/.cache/huggingface/hub (HF_HOME,
                                                         # HF_HUB_CACHE), with progress bars; cached after that
    resolve_model("iic/CosyVoice2-0.5B")                 # ModelScope, with `pip install cosystream[modelscope]`

Once cached, an id resolves without the network (HF_HUB_OFFLINE=1 forbids trying it at all).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from cosystream.errors import CosyStreamError

log = logging.getLogger("cosystream.checkpoint")

DEFAULT_MODEL_ID = "FunAudioLLM/CosyVoice2-0.5B"
MODELSCOPE_ORGS = frozenset({"iic"})  # where ModelScope publishes CosyVoice (its Hugging Face org is FunAudioLLM)
_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelNotFound(CosyStreamError):
    """A model name that is neither a directory nor an id that could be fetched."""


def is_model_id(name: str) -> bool:
    """ORG/NAME, as hubs spell ids (a path that exists is a directory, never an id)."""
    return bool(_MODEL_ID.match(name)) and not Path(name).expanduser().exists()


def resolve_model(name: str | Path) -> Path:
    """The local directory for a model directory or a hub id (downloaded on first use)."""
    text = str(name)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFound(f"model: {text} is a file, not a model directory")
    if not is_model_id(text):
        raise ModelNotFound(f"model: no directory {text}, and it is not a model id like {DEFAULT_MODEL_ID}")
    t0 = time.perf_counter()
    org = text.split("/", 1)[0]
    local = _from_modelscope(text) if org in MODELSCOPE_ORGS else _from_huggingface(text)
    log.info("event=model_resolved model=%s dir=%s resolve_s=%.2f", text, local, time.perf_counter() - t0)
    return local


def _from_huggingface(model_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(model_id))
    except RepositoryNotFoundError:
        raise ModelNotFound(f"model: no directory {model_id}, and no model of that id on the Hugging Face hub (or "
                            "it needs a token: huggingface-cli login)") from None
    except LocalEntryNotFoundError:
        why = ("downloads are off (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
               else "the hub could not be reached")
        raise ModelNotFound(f"model: no directory {model_id}, and no model of that id in the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}), and {why}: download it once with the network on, or give "
                            "a model directory") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"model: downloading {model_id} failed: {exc}") from None


def _from_modelscope(model_id: str) -> Path:
    try:
        from modelscope import snapshot_download
    except ImportError:
        name = model_id.split("/", 1)[1]
        raise ModelNotFound(f"model: {model_id} is a ModelScope id: pip install 'cosystream[modelscope]', or use "
                            f"the Hugging Face id FunAudioLLM/{name}") from None
    try:
        return Path(snapshot_download(model_id))
    except Exception as exc:  # modelscope raises its own types and plain ones for network and missing ids
        raise ModelNotFound(f"model: fetching {model_id} from ModelScope failed: {exc}") from None
