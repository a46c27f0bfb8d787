"""Layer 0, the plumbing every stage shares and none owns: files written atomically and deleted only when
mmfast made them (``fsutil``), process pools that never fork this process (``pool``), quiet third-party
start-up (``quiet``), and the installed commands' names (``commands``). Imports nothing else of mmfast."""
