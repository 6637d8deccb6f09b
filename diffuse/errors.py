"""User-facing errors: each names the problem; the CLI prints them without a traceback."""


class DiffuseError(Exception):
    """Base class for errors a user or a remote peer can cause and should read."""


class ModelError(DiffuseError):
    """A model is missing, corrupt, or of an unsupported architecture."""


class ProtocolError(DiffuseError):
    """A peer sent bytes that do not follow the Diffuse wire protocol."""
