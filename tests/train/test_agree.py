"""Processes that stop together (mmfast/train/agree.py) on the val split too: two gloo processes evaluate
through ``AgreedLoader``; one cannot get its third batch (a shard refused). Both stop at that batch within
seconds: the one with its own error, the other with a ``PeerFailure`` naming it, where without the agreement
the other would finish its batches and wait in the evaluation's all-reduce until the launcher tore it down."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmfast.remote.errors import PermanentRemoteError
from mmfast.train.agree import AgreedLoader, BatchAgreement
from mmfast.train.heartbeat import PeerFailure
from tests.conftest import spawn_two

URL = "s3://bucket/shards/00003.tar"


class _ValBatches:
    """A val loader of four batches; on rank 1 the third raises what a refused shard raises."""

    num_classes = 3

    def __init__(self, rank: int):
        self.rank = rank

    def __len__(self) -> int:
        return 4

    def __iter__(self):
        for i in range(4):
            if self.rank == 1 and i == 2:
                raise PermanentRemoteError(f"{URL}: access denied (403); check the credentials", URL)
            yield {"id": torch.tensor([i])}


def _worker(rank: int, init: str, out_dir: str, agree: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    seen, error = [], None
    try:
        agreement = BatchAgreement(rank, 2, timeout_s=30)
        loader = _ValBatches(rank)
        loader = AgreedLoader(loader, agreement, "the val split after epoch 3:") if agree else loader
        assert loader.num_classes == 3 and len(loader) == 4  # what a task reads of its loader
        for batch in loader:
            seen.append(int(batch["id"]))
    except (PeerFailure, PermanentRemoteError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"seen": seen, "error": error}))
        if agree or rank == 1:
            dist.destroy_process_group()
    os._exit(0)  # without the agreement rank 0 would now wait in the evaluation's all-reduce: not run here


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agree", [True, False], ids=["agreed", "alone"])
def test_a_val_batch_one_process_cannot_get_stops_both_there(tmp_path, agree):
    spawn_two(_worker, (f"file://{tmp_path / 'pg'}", str(tmp_path), agree), 60)
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert said[1] == {"seen": [0, 1], "error": said[1]["error"]} and "access denied" in said[1]["error"]
    if agree:
        assert said[0]["seen"] == [0, 1]  # stopped at the same batch
        assert said[0]["error"].startswith("PeerFailure: rank 0: stopping at the val split after epoch 3: batch 2")
        assert URL in said[0]["error"] and "rank 1: PermanentRemoteError" in said[0]["error"]
    else:  # the case the agreement is for: rank 0 took every batch and knows of no failure
        assert said[0] == {"seen": [0, 1, 2, 3], "error": None}
