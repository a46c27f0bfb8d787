"""Layer 1, the prepared-directory contract: its file names and reader (``dataset.PreparedDataset``), the
image checks every stage applies (``validate``), the tokenizer (``tokenizer``) and the token cache
(``token_cache``). Imports only ``mmfast.util``."""
