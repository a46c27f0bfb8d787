"""Layer 3, preparation: the data users have (read by ``mmfast.inputs``) checked, labelled, split, tokenized and
written as a prepared directory (``core.prepare_dataset``), in parts on several machines (``parts``), with
optional downscaled copies (``downscale``) and WebDataset export (``wds_export``); the built-in demo set
(``demo``). Imports ``mmfast.inputs``, ``mmfast.data`` and ``mmfast.util``."""
