"""User-facing errors: each names the problem; the CLI prints them without a traceback."""


class DiffuseError(Exception):
    """Base class for errors a user or a remote peer can cause and should read."""


class ModelError(DiffuseError):
    """A model is missing, corrupt, or of an unsupported architecture."""


class ProtocolError(DiffuseError):
    """A peer sent bytes that do not follow the Diffuse wire protocol."""


class FetchError(DiffuseError):
    """A file fetched from a peer was refused: the peer did not serve it, broke off, or sent
    bytes other than those its announced hash names (nothing of it is kept)."""


class Rewind(Exception):
    """Not an error a user sees: a deferred spot check caught a peer, and every stage has been
    rolled back to `length` committed tokens (the caught peer replaced). Whoever drives the
    generation recomputes from there; nothing after it may have been shown."""

    def __init__(self, length: int):
        super().__init__(f"rewind to {length} committed tokens")
        self.length = length


def first_leaf(eg: BaseException) -> BaseException:
    """The first error inside nested exception groups (a nursery's), as itself."""
    while isinstance(eg, BaseExceptionGroup):
        eg = eg.exceptions[0]
    return eg
