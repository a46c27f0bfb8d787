"""Every process of a run learns, at the same batch, that one of them could not get its next batch.

Without this, a process whose loader raised (a shard refused with 403, a checksum that does not match) stops,
and the others go on into the step's gradient all-reduce and wait there until ``--dist-timeout``, then name
it only as gone quiet. ``agreed(batches, ...)`` instead has the processes exchange one flag per batch, before
the forward pass: all carry on, or all stop at that batch, the failing process with its own error and the
others with a ``PeerFailure`` that repeats it, no step taken and no checkpoint written (the last one intact).

The flag goes over a CPU (gloo) group: the exchange never waits on the GPU's queue. It is a sync point per
micro-batch, so the engine turns it on where faults come from the network: a run that streams shards from a
store (``--shard-cache``), on the train batches and on the val split's (``AgreedLoader``). Local files that
go bad are skipped by the loader instead (``FileHealth``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from mmfast.train.heartbeat import PeerFailure

_OK, _FAILED, _ENDED = 0, 1, 2


class BatchAgreement:
    """The group the processes agree in: the default one when it is gloo, else a gloo group of all ranks
    (created here: every process must construct this at the same point of the run)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        self.group = None
        if dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def exchange(self, state: int) -> list[int]:
        """Every process's state (``_OK``, ``_FAILED``, ``_ENDED``), by rank."""
        states = torch.zeros(self.world_size, dtype=torch.int64)
        states[self.rank] = state
        dist.all_reduce(states, group=self.group)
        return states.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any process (a CPU all-reduce: it never waits for the GPU's queue)."""
        flags = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(flags, group=self.group)
        return bool(flags[0])

    def messages(self, message: str) -> list[str]:
        """Every process's message, by rank (only called when one failed: every process calls it then)."""
        return [m or "" for m in self.gathered(message)]

    def gathered(self, obj) -> list:
        """Every process's ``obj`` (picklable), by rank: every process calls it at the same point."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def agreed(batches: Iterable, agreement: BatchAgreement | None, where: Callable[[], str]) -> Iterator:
    """``batches``, stopped on every process at the batch where one of them failed or ran out.

    Args:
        agreement: None for a single process (``batches`` as they come).
        where: ``where()`` describes the batch about to be taken ("batch 12 of epoch 3"), for the messages.

    Raises:
        the failing process's own error there; ``PeerFailure`` on the others; RuntimeError on all when the
        processes' loaders ran out at different batches (they must have the same length).
    """
    it = iter(batches)
    if agreement is None:
        yield from it
        return
    while True:
        error, batch, state = None, None, _OK
        try:
            batch = next(it)
        except StopIteration:
            state = _ENDED
        except Exception as e:  # noqa: BLE001 - every process must hear of any failure, then it is re-raised
            error, state = e, _FAILED
        states = agreement.exchange(state)
        if _FAILED in states:
            said = agreement.messages(f"{type(error).__name__}: {error}" if error is not None else "")
            if error is not None:
                raise error
            failed = [r for r, s in enumerate(states) if s == _FAILED]
            who = "; ".join(f"rank {r}: {said[r].splitlines()[0][:300]}" for r in failed)
            raise PeerFailure(
                f"rank {agreement.rank}: stopping at {where()} with the other processes, because "
                f"{'they' if len(failed) > 1 else 'one'} could not get {'their' if len(failed) > 1 else 'its'} "
                f"batch ({who}); the last checkpoint is intact: fix that, then --resume latest"
            )
        if _ENDED in states:
            if any(s != _ENDED for s in states):
                raise RuntimeError(
                    f"rank {agreement.rank}: the processes' loaders ran out at different batches ({where()}: "
                    f"ended on ranks {[r for r, s in enumerate(states) if s == _ENDED]}); they must have the "
                    "same length"
                )
            return
        yield batch


class AgreedLoader:
    """``loader`` whose iteration is ``agreed``: what the engine hands ``task.evaluate`` when the processes
    agree, so a val batch one process cannot get stops them all there too, not only a train batch (every
    other attribute is the loader's: the task reads ``num_classes``, ``batch_size``, ...)."""

    def __init__(self, loader, agreement: BatchAgreement, label: str):
        self.loader, self.agreement, self.label = loader, agreement, label

    def __iter__(self) -> Iterator:
        taken = 0  # read by the message when a batch fails: the count then

        def where() -> str:
            return f"{self.label} batch {taken}"

        for batch in agreed(self.loader, self.agreement, where):
            yield batch
            taken += 1

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)
