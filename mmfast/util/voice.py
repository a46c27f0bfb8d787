"""How a message names a setting: as its flag to a command-line user (``--max-pixels``), as its argument to a
Python caller (``max_pixels=``).

Library code words a message once, through ``setting`` (or ``said`` for a phrase). Each command's ``main`` runs
under ``command_line``, and its ``Parser`` tells which flags the command has (``hear_flags``); everyone else
is a Python caller. The choice lives in a context variable. A worker process or a pool thread does not inherit
it, so ``util.pool`` hands it over (``carried``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextvars import ContextVar

# None: a Python caller; else the command line, with the flags the running command has (empty until parsed)
_FLAGS: ContextVar[frozenset[str] | None] = ContextVar("mmfast_command_flags", default=None)
_UNSET = object()


def command_line(main: Callable) -> Callable:
    """Decorate a command's ``main(argv)``: the messages made while it runs name flags."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None):
        token = _FLAGS.set(frozenset())
        try:
            return main(argv)
        finally:
            _FLAGS.reset(token)  # also undoes what the parser set meanwhile

    return run


def hear_flags(flags: Iterable[str]) -> None:
    """The running command's flags (its parser's), so ``setting`` picks the one it has; nothing for a Python
    caller."""
    if _FLAGS.get() is not None:
        _FLAGS.set(frozenset(flags))


def on_command_line() -> bool:
    """Whether the messages made now are for a command-line user."""
    return _FLAGS.get() is not None


def said(command_line: str, python: str) -> str:
    """The words for whoever made the setting: ``command_line`` for a command's user, else ``python``."""
    return command_line if on_command_line() else python


def setting(arg: str, *flags: str, value: object = _UNSET) -> str:
    """A setting's name in the caller's words.

    Args:
        arg: its argument name for a Python caller ("max_pixels").
        flags: the flags that set it, the preferred first (default: the argument's, "--max-pixels"). The first
            one the running command has is named.
        value: a value to name with it: "--cpu-resize dali" / "cpu_resize='dali'"; a bool names the flag
            alone ("--no-cache-decoded" / "cache_decoded=False").

    Returns:
        "--max-pixels" on the command line, "max_pixels=" for a Python caller.
    """
    known = _FLAGS.get()
    if known is None:
        return f"{arg}=" if value is _UNSET else f"{arg}={value!r}"
    flags = flags or ("--" + arg.replace("_", "-"),)
    flag = next((f for f in flags if f in known), flags[0])
    return flag if value is _UNSET or isinstance(value, bool) else f"{flag} {value}"


def carried(fn: Callable) -> Callable:
    """``fn`` to run in another process or thread in the words of this one (picklable when ``fn`` is)."""
    return functools.partial(_run_in, _FLAGS.get(), fn)


def _run_in(flags: frozenset[str] | None, fn: Callable, *args, **kwargs):
    token = _FLAGS.set(flags)
    try:
        return fn(*args, **kwargs)
    finally:
        _FLAGS.reset(token)
