"""The installed commands, by the names users type (pyproject's ``[project.scripts]``): every message that
tells a user what to run names one of these, so a renamed command changes here only. ``tools/*.py`` wrap
the same entry points for a checkout."""

PREPARE = "mmfast-prepare"
TRAIN = "mmfast-train"
PROFILE = "mmfast-profile"
PREDICT = "mmfast-predict"
EVALUATE = "mmfast-evaluate"
EXPORT = "mmfast-export"
