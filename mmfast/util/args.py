"""argparse as mmfast's commands use it: one-line errors, --help with defaults, one-line messages of
failed writes."""

import argparse
import difflib
import re
import sys

from mmfast.util.voice import hear_flags

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}  # kB, MB..., and KiB, MiB...
_SIZE = re.compile(r"\s*(-?\s*(?:\d+(?:\.\d*)?|\.\d+))\s*(?:([kmgt])(i?)b?|(b?))\s*", re.IGNORECASE)


RENAMED = {"--cache-limit-gb": "--cache-limit (bytes or a unit: 50GB, 20GiB)"}  # flags that were renamed


class Parser(argparse.ArgumentParser):
    """argparse with mmfast's one-line errors: ``error: ...`` and exit 2, not the whole usage above it; a
    renamed flag's new name in its error; and no abbreviations (``--epoch`` is not ``--epochs``: a prefix
    would silently mean another flag once one is added that shares it)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        hear_flags(self._option_string_actions)  # messages name this command's flags (util/voice)
        return super().parse_known_args(self._joined_negatives(args), namespace)

    def _joined_negatives(self, args: list[str] | None) -> list[str]:
        """``args`` with ``--flag VALUE`` joined into ``--flag=VALUE`` where the flag takes one value and VALUE
        starts with a minus and a digit (-5GB, -0.7,1.7, -1e-3): argparse takes such a value for a flag and says
        "expected one argument", so the value's own check never said what is wrong."""
        args = sys.argv[1:] if args is None else list(args)
        out, i = [], 0
        while i < len(args):
            action = self._option_string_actions.get(args[i]) if isinstance(args[i], str) else None
            value = args[i + 1] if action is not None and action.nargs is None and i + 1 < len(args) else ""
            if isinstance(value, str) and re.match(r"-\.?\d", value):  # a flag of one value, a negative one
                out.append(f"{args[i]}={value}")
                i += 2
            else:
                out.append(args[i])
                i += 1
        return out

    def error(self, message: str):
        renamed = [f"{old} is now {new}" for old, new in RENAMED.items() if old in message]
        hints = renamed or self._close_flags(message)
        hint = f"; {'; '.join(hints)}" if hints else ""
        self.exit(2, f"error: {message}{hint} (see {self.prog} --help)\n")

    def _close_flags(self, message: str) -> list[str]:
        """The hint "did you mean --epochs for --epoch?" for the unknown flags of an "unrecognized arguments"
        message that are near one of this command's flags (a typo, a prefix): a hint, never taken for it."""
        if not message.startswith("unrecognized arguments:"):
            return []
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        near = {}
        for word in message.split(":", 1)[1].split():
            name = word.split("=", 1)[0]
            if name.startswith("--") and name not in flags:
                longer = [f for f in flags if f.startswith(name)]  # a prefix of one flag, or a typo of one
                m = longer if len(longer) == 1 else difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
                near |= {name: m[0]} if m else {}
        if not near:
            return []
        return ["did you mean " + ", ".join(f"{flag} for {typo}" for typo, flag in near.items()) + "?"]


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


def parse_size(text: object, what: str = "a size") -> int:
    """Bytes from ``text``: a number of bytes, or one with a unit, decimal (kB, MB, GB, TB: 1000s) or binary
    (KiB, MiB, GiB, TiB: 1024s), case and spaces ignored ("500MB", "20 GiB", "1.5g"). ``what`` names the
    setting in the error.

    Raises:
        ValueError: not a size, or not above 0 bytes.
    """
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise ValueError(f"{what} must be bytes or a size with a unit (500MB, 20GiB), got {text!r}")
    unit = (m.group(2) or "").lower()
    scale = 2 ** (10 * "kmgt".index(unit) + 10) if unit and m.group(3) else _UNITS[unit]
    nbytes = int(float(m.group(1).replace(" ", "")) * scale)
    if nbytes <= 0:
        raise ValueError(f"{what} must be above 0 bytes, got {text!r}")
    return nbytes


def format_size(nbytes: float) -> str:
    """``nbytes`` as the binary unit that reads best: "512B", "1.5KiB", "20.0GiB" (what ``parse_size`` reads)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024
    return f"{nbytes:.1f}TiB"
