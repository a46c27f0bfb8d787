"""Layer 3, preparation: the data users have (read by ``mmfast.inputs``) checked (``checks``), labelled, split
(``split``), tokenized and written as a prepared directory (``core.prepare_dataset``; its settings and names in
``config``, reuse in ``fingerprint`` and ``reuse``), in parts on several machines (``parts``), with optional
downscaled copies (``downscale``) and WebDataset export (``wds_export``); the built-in demo set (``demo``).
Imports ``mmfast.inputs``, ``mmfast.data`` and ``mmfast.util``."""
