"""User-facing errors: one line, the value, what is allowed, the flag to change.

Internal bugs use assert; everything a user can cause raises a subclass of KvfitError, which
the CLI prints as ``error: <message>`` with no traceback.
"""


class KvfitError(Exception):
    """A mistake in a user's input or an impossible setting, explained in one line."""


class ConfigError(KvfitError, ValueError):
    """An invalid setting (flag, keyword argument or model config)."""


class CapacityError(KvfitError):
    """The KV cache cannot be planned or allocated with the given memory and settings."""


class RequestError(KvfitError, ValueError):
    """A request that can never be served (too long, bad sampling parameters).

    param names the request field at fault and code says why (OpenAI's error fields), so the
    server maps it to a 400 without checking the request again.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineDeadError(KvfitError):
    """The executor cannot run another step (a tensor-parallel rank exited or failed, or a failure stopped
    the ranks): the engine must be started again. A server answers every request 503 from then on."""
