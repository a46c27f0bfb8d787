"""Documentation tools: the generated reference pages (gen_reference), the site build's link hook (hooks), and
the sentence statistics of docs/contributing.md's writing rule (sentence_stats)."""
