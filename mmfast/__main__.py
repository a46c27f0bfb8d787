"""``python -m mmfast COMMAND [flags]``: the mmfast-COMMAND console scripts, for an environment whose scripts are
not on PATH. ``python -m mmfast`` alone lists the commands."""

from __future__ import annotations

import difflib
import importlib
import sys

from mmfast.util.args import summary_of

COMMANDS = {  # what pyproject.toml's [project.scripts] install as mmfast-<name>
    "prepare": "mmfast.cli.prepare",
    "train": "mmfast.cli.train",
    "profile": "mmfast.cli.profile_run",
    "evaluate": "mmfast.cli.evaluate",
    "predict": "mmfast.cli.predict",
    "export": "mmfast.cli.export",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m mmfast COMMAND [flags]   (or mmfast-COMMAND [flags]); COMMAND --help for its flags\n"
        )
        for name, module in COMMANDS.items():
            print(f"  {name:<9} {summary_of(importlib.import_module(module).__doc__ or '').split('. ')[0]}")
        return 0
    if argv[0] not in COMMANDS:
        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        print(f"error: unknown command '{argv[0]}'; {hint}choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    sys.argv = [f"mmfast-{argv[0]}", *argv[1:]]  # what the command's --help and errors name
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
