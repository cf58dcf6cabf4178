"""Heartbeat records: verification, freshness (replay, going backwards, moved or deleted records) and the second
signal that confirms a dead replica on this node."""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import torch.distributed as dist

from lightning_het.reliability.watchdog import BOOT_ID, Phase, Watchdog, process_alive

HOST = socket.gethostname()


def _record(rank: int, beat: int, seq: int = 0, *, host: str = HOST, pid: int | None = None) -> str:
    return json.dumps({
        "beat": beat, "seq": seq, "batch": 1, "phase": int(Phase.BACKWARD), "eval_stage": "", "eval_batch": -1,
        "armed": True, "waiting": False, "state": "running", "error": "", "host": host, "boot": BOOT_ID,
        "pid": os.getpid() if pid is None else pid, "rank": rank,
    })  # fmt: skip


def _book(alive=lambda pid: True, namespace: str = "ns/0/", **kwargs) -> Watchdog:
    """Replica 0's watchdog (not started; heartbeats stale after 1 s) reading replica 1's records."""
    dog = Watchdog(dist.HashStore(), 0, 2, 3.0, token="secret", namespace=namespace, **kwargs)
    dog.alive = alive  # whether a process of this node lives (the second signal)
    assert dog.stale_after == 1.0
    return dog


def test_a_genuine_record_is_read_and_forgeries_are_tampering(caplog):
    book = _book()
    assert book.genuine(1, book.sign("hb/1", _record(1, 1)))["beat"] == 1
    assert book.genuine(1, _record(1, 2)) is None  # unsigned
    assert "hb/1" in book.tampered
    assert "tampering with the job's store detected under 'hb/1'" in caplog.text


def test_a_record_moved_to_another_key_or_watchdog_is_rejected():
    book, other = _book(), _book(namespace="ns/1/")
    assert book.genuine(1, book.sign("hb/0", _record(0, 5))) is None  # replica 0's record under replica 1's key
    assert book.genuine(1, other.sign("hb/1", _record(1, 5))) is None  # another watchdog's key space
    assert book.genuine(1, book.sign("hb/1", _record(0, 5))) is None  # signed for hb/1 but naming replica 0


def test_a_replayed_older_record_is_ignored_and_the_last_genuine_one_kept():
    book = _book()
    old, new = book.sign("hb/1", _record(1, 3, seq=3)), book.sign("hb/1", _record(1, 4, seq=4))
    book.status(1, old, now=1.0)
    assert book.status(1, new, now=2.0).silent_for == 0.0
    status = book.status(1, old, now=2.5)  # going backwards
    assert "hb/1" in book.tampered and book.seen[1][2]["beat"] == 4 and status.silent_for == 0.5


def test_a_deleted_record_is_tampering_not_silence():
    book = _book()
    book.status(1, book.sign("hb/1", _record(1, 1)), now=0.2)
    status = book.status(1, None, now=0.5)
    assert "hb/1" in book.tampered and status.batch == 1 and status.silent_for == 0.5


def test_a_silent_replica_on_this_node_is_dead_only_if_its_process_is_gone(caplog):
    alive = _book(alive=lambda pid: True)
    alive.status(1, alive.sign("hb/1", _record(1, 1)), now=0.0)
    status = alive.status(1, None, now=30.0)
    assert status.silent_for == 0.0 and status.stalled_for == 0.0  # hidden, not dead: nobody is blamed
    assert "not presumed dead" in caplog.text
    dead = _book(alive=lambda pid: False)
    dead.status(1, dead.sign("hb/1", _record(1, 1)), now=0.0)
    assert dead.status(1, None, now=30.0).silent_for == 30.0


def test_a_silent_remote_replica_still_counts_as_silent():
    book = _book(alive=lambda pid: True)
    book.status(1, book.sign("hb/1", _record(1, 1, host="elsewhere")), now=0.0)
    assert book.status(1, None, now=30.0).silent_for == 30.0


def test_process_alive():
    assert process_alive(os.getpid())
    assert not process_alive(2**22 + 12345)


def test_a_launched_replica_is_judged_by_its_process():
    def launched(code):
        return SimpleNamespace(poll=lambda: code)

    book = _book(alive=lambda pid: False)
    assert book.status(1, None, now=30.0, child=launched(None)).silent_for == 0.0  # never heard of, running: not silent
    assert book.status(1, None, now=30.0, child=launched(0)).state == "finished"  # exited with 0: finished
    assert book.status(1, None, now=30.0, child=launched(3)).silent_for == 30.0


def test_a_replica_never_heard_of_is_checked_through_the_identities_exchanged_at_start():
    book = _book(alive=lambda pid: True, peers={1: (HOST, BOOT_ID, 4242)})
    assert book.status(1, None, now=30.0).silent_for == 0.0


def test_lightnings_infinite_barrier_waits_also_where_code_has_no_qualname():
    """Python 3.10 code objects have no ``co_qualname``: the barrier around ``prepare_data`` is known by its file."""
    from types import SimpleNamespace

    from lightning_het.reliability.watchdog import inside_torch_distributed

    def _waits(code: SimpleNamespace) -> bool:
        return inside_torch_distributed(SimpleNamespace(f_code=code, f_back=None))

    barrier = os.path.join("site-packages", "lightning", "fabric", "utilities", "distributed.py")
    assert _waits(SimpleNamespace(co_filename=barrier, co_name="__exit__"))  # 3.10
    assert _waits(SimpleNamespace(co_filename=barrier, co_name="__exit__", co_qualname="_InfiniteBarrier.__exit__"))
    assert not _waits(SimpleNamespace(co_filename=barrier, co_name="__exit__", co_qualname="Other.__exit__"))
    user = os.path.join("home", "me", "train.py")
    assert not _waits(SimpleNamespace(co_filename=user, co_name="__exit__"))
