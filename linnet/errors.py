"""Errors that Linnet shows to users: each names the problem, the CLI prints them without a stack trace."""


class LinnetError(Exception):
    """Base of every error whose message is meant for the user."""


class UnsupportedModel(LinnetError):
    """The checkpoint asks for something Linnet does not implement (named in the message)."""


class WeightError(LinnetError):
    """A tensor is missing, misshapen, or of a type Linnet cannot read."""


class CacheFull(LinnetError):
    """The prompt plus the requested tokens do not fit in the KV cache."""


class BackendUnavailable(LinnetError):
    """The backend cannot run on this machine (e.g. CUDA graphs without CUDA)."""


class RegistryError(LinnetError):
    """A registry entry is missing or breaks the schema (the message names the file and the field)."""


class ResultsError(LinnetError):
    """A results file breaks the results format (the message names the file and the field)."""


class TokenError(LinnetError):
    """A token id outside the model's vocabulary."""
