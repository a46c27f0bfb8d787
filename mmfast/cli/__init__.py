"""The command-line entry points, one module per command, each with ``main(argv: list[str] | None) -> int``.

Installed as console scripts (pyproject's ``[project.scripts]``): mmfast-prepare, mmfast-train,
mmfast-profile, mmfast-predict, mmfast-evaluate, mmfast-export. ``tools/*.py`` wrap the same functions for
a checkout, and ``accelerate launch -m mmfast.cli.train`` starts several processes. Nothing here imports
torch at module level: ``--help`` is quick and a Ctrl-C during start-up reaches the command's handler.
"""

from mmfast.util.args import HelpFormatter, Parser, summary_of, write_failure

__all__ = ["HelpFormatter", "Parser", "summary_of", "write_failure"]
