"""Errors a user can fix. The CLI prints them as one line and exits non-zero, without a traceback."""

import errno


class UserError(Exception):
    """Bad input: the message says what to change."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


def why(e: OSError) -> str:
    """An OSError in a user's words: a full disk is the common case."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if e.errno == errno.EFBIG:
        return "a file size limit was reached (ulimit -f)"
    return e.strerror or str(e)
