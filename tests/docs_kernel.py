"""The interpreter of one documentation page's python blocks (tests/docs_harness.py starts it).

It reads one JSON request per line on stdin, {"source", "path", "line"}, runs the source in the page's one
namespace (its line numbers those of the page, so a traceback names the page's line), and answers
{"ok": true} or {"ok": false, "error": traceback} on the file descriptor given as its argument. The
blocks' own output goes to stdout and stderr."""

import json
import os
import sys
import traceback


def main(reply_fd: int) -> None:
    namespace = {"__name__": "__main__"}
    for request in sys.stdin:
        req = json.loads(request)
        code = "\n" * req["line"] + req["source"]  # the block's first line is the one after its fence
        try:
            exec(compile(code, req["path"], "exec"), namespace)
            reply = {"ok": True}
        except BaseException:  # a SystemExit or KeyboardInterrupt in a block fails that block too
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(reply_fd, (json.dumps(reply) + "\n").encode())


if __name__ == "__main__":
    main(int(sys.argv[1]))
