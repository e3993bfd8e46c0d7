"""User-facing errors: each one prints as a single line and exits non-zero (or answers 4xx)."""


class MoestreamError(Exception):
    """An error the user can cause and fix; the CLI prints `error: <message>` and nothing else."""


class SourceError(MoestreamError):
    """A checkpoint folder that cannot be packed (missing, incomplete, unsupported)."""


class StoreError(MoestreamError):
    """A store that is missing, unfinished, truncated, altered or from another version."""


class UnsupportedModelError(MoestreamError):
    """A model type or config field that the engine does not run."""


class BudgetError(MoestreamError):
    """A memory budget too small for one step."""


class ConfigError(MoestreamError):
    """An engine option out of its range."""


class RequestError(MoestreamError):
    """A request the caller can fix: a parameter out of range, a prompt too long or with ids outside the vocabulary
    (the server answers 400; every other error during generation is the server's own, 500)."""
