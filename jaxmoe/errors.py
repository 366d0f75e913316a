"""User-facing errors: one line that names what is wrong and how to fix it (pure Python)."""

from jaxmoe.config import ConfigError


class UserError(Exception):
    """Bad input from the user (paths, data, checkpoints, flags). The CLI prints it on one line and
    exits non-zero; nothing on disk has been changed when it is raised."""


__all__ = ["ConfigError", "UserError"]
