"""argparse as mmfast's commands use it: one-line errors, --help with defaults, one-line messages of
failed writes."""

import argparse


class Parser(argparse.ArgumentParser):
    """argparse with mmfast's one-line errors: ``error: ...`` and exit 2, not the whole usage above it."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with the description as written and each flag's default (when it has one) after its meaning."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def summary_of(doc: str) -> str:
    """A module docstring's first paragraph on one line: a command's --help description."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def write_failure(out: object, e: OSError) -> str:
    """The one-line message of an output that could not be written (``--out`` a file, no permission, a full
    disk): what, where and why, for ``error: ...``."""
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
    return f"writing {out} failed: {e.strerror or e}{where}; free space or fix the path, and re-run"
