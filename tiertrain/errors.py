"""Errors a user can fix. The CLI prints them as one line and exits non-zero, without a traceback."""

import contextlib
import errno


class UserError(Exception):
    """Bad input: the message says what to change."""


class Everywhere(UserError):
    """An error every rank of a job meets alike (from a value they agree on): rank 0 alone says it."""


class ElsewhereError(UserError):
    """This rank stops because another one failed, which says why: nothing to print here."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


def close_all(*closers) -> None:
    """Calls every closer in turn, whatever an earlier one raised (each owns threads or files the next does not
    reach), then raises the first error."""
    first = None
    for close in closers:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - raised below, after the rest have closed
            first = first or e
    if first is not None:
        raise first


def close_quietly(*closers) -> None:
    """close_all where an error already stops the run: every closer called, and what they raise dropped (that
    error is the one to say; a failing disk often fails the closing too)."""
    with contextlib.suppress(Exception):
        close_all(*closers)


def why(e: OSError) -> str:
    """An OSError in a user's words: a full disk is the common case."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if e.errno == errno.EFBIG:
        return "a file size limit was reached (ulimit -f)"
    return e.strerror or str(e)
