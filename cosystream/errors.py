"""Error types that cross layer boundaries; the server maps each one to an HTTP status."""

import json


class CosyStreamError(Exception):
    """Base class of every error cosystream raises on purpose."""


class CheckpointError(CosyStreamError):
    """A model directory is incomplete, truncated or does not match the expected layout.

    The message always starts with the file it is about.
    """


class BadInput(CosyStreamError):
    """User input cannot be used; the message names the field and the reason ("field: reason")."""


class UnknownVoice(BadInput):
    """A registered voice name that is not in the store."""


class VoiceExists(BadInput):
    """Registering a voice under a name that is already taken."""


class Overloaded(CosyStreamError):
    """Admission control refused the request (queue full); retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDead(CosyStreamError):
    """The engine loop stopped; no request can be served."""


class SynthesisFailed(CosyStreamError, RuntimeError):
    """One request failed inside the engine while the engine itself goes on serving.

    `code` says why: "non_finite_output" (a model produced NaN/inf for this request), "out_of_memory"
    (the device ran out of memory on a batch holding it: retrying later may work) or "engine_fault"
    (any other failure of a batch holding it) or "aborted" (cancelled in the engine by someone other than
    its reader). A RuntimeError too, for callers that caught that before.
    """

    def __init__(self, message: str, code: str = "engine_fault") -> None:
        super().__init__(message)
        self.code = code


def error_code(body: str | bytes) -> str | None:
    """The `error.code` of the server's JSON error body (server/errors.py's shape); None for any other body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None
