"""Errors a user can fix. The CLI prints them as one line and exits non-zero, without a traceback."""


class UserError(Exception):
    """Bad input: the message says what to change."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass
