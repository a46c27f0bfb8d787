"""The processes of a launch meet before Accelerate creates their process group: within ``--rendezvous-timeout``
seconds, and stoppable by a signal at every point.

torch's env:// rendezvous connects to the launcher's store in C++. It retries for the process group's whole
timeout (30 minutes for gloo), through EINTR, so no Python signal handler runs meanwhile. ``meet`` first does
the same in Python, in short steps: it waits until MASTER_ADDR:MASTER_PORT accepts a connection and, where
the launcher hosts the store (torchrun, accelerate launch), until every rank has checked in there. It reads
the launcher's variables only to meet; Accelerate still assigns the ranks and devices.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

from mmfast.util.listener import UnknownHost, wait_for_listener

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a rank that checked in looks for the others
_STORE_S = 10.0  # the longest one call to the launcher's store may take
_FIRST_REPORT_S, _REPORT_S = 5.0, 30.0  # a rank still waiting says so after the first, then this often


class RendezvousError(RuntimeError):
    """The processes did not meet in time, or the launcher's address cannot be reached; the message names the
    address and what to check."""


def meet(timeout_s: float) -> None:
    """Wait until the launcher's store answers and every process of the launch has checked in there.

    Does nothing for one process, or when the launcher set no MASTER_ADDR / MASTER_PORT (another kind of
    rendezvous, which Accelerate runs as it is).

    Raises:
        RendezvousError: the store or a process did not come within ``timeout_s`` seconds, the host name does
            not resolve, or MASTER_PORT is no port.
    """
    env = os.environ
    world, host, port = int(env.get("WORLD_SIZE", "1")), env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if world <= 1 or not host or not port:
        return
    wait = _Wait(int(env.get("RANK", "0")), f"{host}:{port}", timeout_s)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(
            f"rank {wait.rank}: MASTER_PORT={port} is no port a process can connect to: give the launcher a "
            "free port (torchrun --master-port 29500, or torchrun --standalone, which picks one)"
        )
    hosted = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # the launcher hosts the store
    if wait.rank == 0 and not hosted:
        return  # rank 0 hosts the store itself, in init_process_group
    _reach(host, int(port), wait)
    if hosted:
        attempt = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        _check_in(host, int(port), world, f"mmfast/rendezvous/{attempt}", wait)


class _Wait:
    """One rank's wait: its deadline, the lines it prints while it waits, the error past the deadline."""

    def __init__(self, rank: int, where: str, timeout_s: float):
        self.rank, self.where, self.timeout_s = rank, where, timeout_s
        self.start = time.monotonic()
        self.next_report = self.start + _FIRST_REPORT_S

    def check(self, state: str) -> None:
        """Say ``state`` now and then; raise past the deadline."""
        now = time.monotonic()
        if now - self.start > self.timeout_s:
            raise RendezvousError(
                f"rank {self.rank}: the processes did not meet at {self.where} within {self.timeout_s:g} s: "
                f"{state}. Check MASTER_ADDR and MASTER_PORT (the launcher's --master-addr / --master-port), that "
                "every node started its launcher with the same --nnodes and --nproc-per-node, and the other "
                "ranks' output for an error; --rendezvous-timeout sets the wait"
            )
        if now >= self.next_report:
            self.next_report = now + _REPORT_S
            log.warning(
                "rank %d: waiting for the other processes at %s (%.0f s of --rendezvous-timeout %g): %s",
                self.rank, self.where, now - self.start, self.timeout_s, state,
            )  # fmt: skip


def _reach(host: str, port: int, wait: _Wait) -> None:
    """Return once ``host:port`` accepts a connection."""
    try:
        wait_for_listener(
            host, port, lambda failure: wait.check(f"nothing accepts a connection there ({failure})")
        )
    except UnknownHost as e:
        raise RendezvousError(
            f"rank {wait.rank}: MASTER_ADDR: {e}: give the launcher the first node's name or address "
            "(--master-addr)"
        ) from None


def _check_in(host: str, port: int, world: int, key: str, wait: _Wait) -> None:
    """Add this process to the count at ``key`` in the launcher's store; return once all ``world`` are in."""
    from torch.distributed import TCPStore  # torch: heavy, and only a multi-process launch gets here

    store = TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=_STORE_S))
    arrived = store.add(key, 1)
    while arrived < world:
        wait.check(f"{arrived} of the {world} processes arrived")
        time.sleep(_POLL_S)
        arrived = store.add(key, 0)
