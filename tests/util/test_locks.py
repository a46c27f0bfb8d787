"""mmfast.util.locks: a lock file deleted under a waiter still excludes, and old free lock files are pruned."""

from __future__ import annotations

import os
import threading
import time

import pytest

from mmfast.util import locks as locks_module
from mmfast.util.locks import PRUNE_AGE_S, file_lock, lock_dir, lock_file_for, prune_locks


@pytest.fixture
def locks(tmp_path, monkeypatch):
    folder = tmp_path / "locks"
    monkeypatch.setenv("MMFAST_LOCK_DIR", str(folder))
    return folder


def _hold(target, spans: dict, name: str, entered: threading.Event, seconds: float, timeout: float) -> None:
    with file_lock(target, timeout=timeout):
        start = time.monotonic()
        entered.set()
        time.sleep(seconds)
        spans[name] = (start, time.monotonic())


def test_a_waiter_whose_lock_file_was_deleted_does_not_enter_beside_the_new_holder(tmp_path, locks, monkeypatch):
    """A waiter blocked on a lock file that is then deleted wakes on a dead inode: it must lock the new file,
    so it waits for the newcomer who created it (plain flock on the old inode let both in at once)."""
    target = tmp_path / "prepared"
    spans, w_in, n_in, waits = {}, threading.Event(), threading.Event(), threading.Event()
    flock = locks_module._flock

    def noted(fd, deadline):
        if threading.current_thread().name == "waiter":
            waits.set()  # it has opened the lock file and is about to wait on it
        return flock(fd, deadline)

    monkeypatch.setattr(locks_module, "_flock", noted)
    with file_lock(target):
        waiter = threading.Thread(target=_hold, args=(target, spans, "waiter", w_in, 0.2, -1), name="waiter")
        waiter.start()
        assert waits.wait(10)
        time.sleep(0.2)  # inside flock's wait
        os.unlink(lock_file_for(target))
        newcomer = threading.Thread(target=_hold, args=(target, spans, "newcomer", n_in, 1.0, 30))
        newcomer.start()
        assert n_in.wait(10)  # a fresh file: the newcomer holds it at once
    waiter.join(30)
    newcomer.join(30)
    assert set(spans) == {"waiter", "newcomer"}
    assert spans["waiter"][0] >= spans["newcomer"][1]


def _aged(path) -> None:
    old = time.time() - PRUNE_AGE_S - 60
    os.utime(path, (old, old))


def test_prune_deletes_old_free_lock_files_only(tmp_path, locks):
    for name in ("old", "held", "fresh"):
        with file_lock(tmp_path / name):
            pass
    _aged(lock_file_for(tmp_path / "old"))
    for name in ("notes.txt", "tool.lock"):  # not names mmfast gives: another tool's files stay
        (locks / name).write_text("not mmfast's")
        _aged(locks / name)
    entered, release = threading.Event(), threading.Event()

    def hold():
        with file_lock(tmp_path / "held"):
            entered.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(10)
    _aged(lock_file_for(tmp_path / "held"))  # old, but held now: its lock is not free
    try:
        assert prune_locks(locks) == 1
    finally:
        release.set()
        holder.join(30)
    left = sorted(p.name.split("-")[0] for p in locks.iterdir())
    assert left == ["fresh", "held", "notes.txt", "tool.lock"]


def test_a_folder_the_user_names_is_never_pruned(tmp_path, locks):
    """MMFAST_LOCK_DIR may be shared between users or machines (NFS caches the names the inode check reads)."""
    locks.mkdir()
    stale = locks / f"train.lock-{1:032x}.lock"
    stale.touch()
    _aged(stale)
    with file_lock(tmp_path / "data"):
        pass
    assert stale.exists()


def test_the_first_lock_of_a_process_prunes_its_folder_and_a_timeout_names_the_path(tmp_path, monkeypatch):
    monkeypatch.delenv("MMFAST_LOCK_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # mmfast's own per-user folder: tmp_path/mmfast-locks
    locks = lock_dir()
    assert locks == tmp_path / "mmfast-locks"
    stale = [locks / f"train.lock-{i:032x}.lock" for i in range(5)]
    for path in stale:
        path.touch()
        _aged(path)
    with file_lock(tmp_path / "data"):
        assert not any(p.exists() for p in stale)
        err = {}

        def try_it():
            try:
                with file_lock(tmp_path / "data", timeout=0.3):
                    pass
            except TimeoutError as e:
                err["e"] = e

        t0 = time.monotonic()
        worker = threading.Thread(target=try_it)
        worker.start()
        worker.join(30)
    assert time.monotonic() - t0 < 5 and "data" in str(err["e"]) and "0.3 s" in str(err["e"])
