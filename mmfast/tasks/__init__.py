"""Layer 2, training objectives: what a task needs from a batch, its loss, its evaluation figures, what
"best" means and its summary (``classification``). The training loop calls a task and knows none of that;
a new objective is one module here plus its models. Imports ``mmfast.data`` and ``mmfast.util``."""
