"""Error types that cross layer boundaries; the server maps each one to an HTTP status."""


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
