"""Documentation tools: the sentence statistics of docs/contributing.md's writing rule."""
