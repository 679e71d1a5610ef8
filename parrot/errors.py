"""Exceptions shared by every layer. Each carries a message meant for the user, not a traceback."""


class ParrotError(Exception):
    """Base class: an error Parrot reports to the caller with a clear message."""


class ModelLoadError(ParrotError):
    """The model file or directory is missing, corrupt or of an unsupported kind."""


class InvalidRequestError(ParrotError):
    """The request itself is wrong (empty prompt, too long, bad sampling values, ...)."""


class NotFoundError(ParrotError):
    """A named object (context, session, variable, ...) does not exist."""


class ConflictError(ParrotError):
    """The request conflicts with current state (e.g. freeing a context that is running)."""


class AbortedError(ParrotError):
    """The primitive was aborted (its client went away or asked to cancel) before it finished."""
