"""What marks a sample in a batch as not to be counted (docs/architecture.md, "Batch"): a padding entry or a
stand-in for a bad image has sample id ``PAD_ID`` and label ``IGNORE_LABEL`` (cross-entropy's default
``ignore_index``), so loaders and tasks agree on it without importing each other."""

IGNORE_LABEL = -100
PAD_ID = -1
