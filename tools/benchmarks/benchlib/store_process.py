"""An S3-compatible store and throttled links to it in a process of their own, for benchmarks: moto's server
and ``FaultProxy``s are Python threads, and in the benchmark's own process they would take the GIL from the
loader they feed (a real store's work happens on other machines).

    with StoreProcess(bandwidths_mb=[50, 200], latency_ms=20) as store:
        store.direct              # http://127.0.0.1:PORT, moto itself
        store.links[50.0]         # http://127.0.0.1:PORT, moto through a 50 MB/s, 20 ms link

The child prints its addresses as one JSON line and serves until its stdin closes (so it never outlives the
benchmark); only loopback addresses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, logging, os, sys
if {cpus!r}:
    os.sched_setaffinity(0, {cpus!r})  # before any thread starts: they inherit it
sys.path.insert(0, {benchlib!r})
from fault_proxy import FaultProxy
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
direct = f"http://{{host}}:{{port}}"
links = {{}}
for mb in {bandwidths!r}:
    links[mb] = FaultProxy(direct, bandwidth_bytes_per_s=mb * 1e6, latency_s={latency!r}).start().url
print(json.dumps({{"direct": direct, "links": links}}), flush=True)
sys.stdin.read()  # until the benchmark closes it (or dies)
"""


class StoreProcess:
    """moto's S3 server and one throttled link per bandwidth, served by a child process (on ``cpus`` only, when
    given: a store on cores of its own, as a remote one is)."""

    def __init__(self, bandwidths_mb: list[float], latency_ms: float, cpus: list[int] | None = None):
        code = _CHILD.format(
            cpus=sorted(cpus or []),
            benchlib=str(Path(__file__).resolve().parent),
            bandwidths=[float(b) for b in bandwidths_mb],
            latency=latency_ms / 1000,
        )
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._proc = subprocess.Popen([sys.executable, "-c", code], **pipes)
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the store process exited ({self._proc.returncode}) before it served")
        found = json.loads(line)
        self.direct: str = found["direct"]
        self.links: dict[float, str] = {float(k): v for k, v in found["links"].items()}

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
