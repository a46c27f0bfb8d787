"""Run by each peer script first: mmfast cannot be imported in this process (its editable install's finder and
any path into a checkout are removed, and the name is blocked), so what loads the folder is the peer alone."""

import sys

sys.modules["mmfast"] = None  # `import mmfast` raises ImportError
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "site-packages" in p or "lib/python" in p]
