"""User-facing errors: one line that names what is wrong and how to fix it (pure Python).

Both live here, below everything else, so that any module (config, architecture records,
checkpoints) can raise them without importing another jaxmoe module.
"""


class ConfigError(ValueError):
    """A bad configuration: the message is one line and names the offending key."""


class UserError(Exception):
    """Bad input from the user (paths, data, checkpoints, flags). The CLI prints it on one line and
    exits non-zero; nothing on disk has been changed when it is raised."""


__all__ = ["ConfigError", "UserError"]
