"""What a writer and readers do when the store's mount fails some operations, as NFS and Lustre
clients do (``EIO``, ``ESTALE``, sizes from an attribute cache). The faults are injected where
the store reads a file (its ``read_small``, the reads and ``fstat`` under it), everything else is
the real store on a real filesystem."""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

import dbsync
from dbsync.leases import DEAD_LEASE_GRACE, MAX_LEASE_TIMEOUT, LeaseMonitor
from dbsync.store import Store


class LeaseReadsFail(Store):
    """A store whose reads of ``readers/<reader>.json`` fail with ``code`` (``failures`` times
    in a row, then read well; None: for ever)."""

    def __init__(self, root: str, reader: str, code: int, failures: int | None = None):
        super().__init__(root, create=False)
        self.lease_name = f"{reader}.json"
        self.code = code
        self.failures = failures

    def read_small(self, parts: tuple[str, ...], *args: Any, **kwargs: Any) -> bytes | None:
        if parts[-1] == self.lease_name and (self.failures is None or self.failures > 0):
            if self.failures is not None:
                self.failures -= 1
            raise OSError(self.code, os.strerror(self.code))
        return super().read_small(parts, *args, **kwargs)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_unreadable_lease_still_holds_its_slot(root):
    """One failed read of a live reader's lease (EIO, ESTALE) made the writer take it for
    gone and overwrite the slot that reader held. An unreadable lease now counts as it read
    last (or, never read, as holding every slot) until its lease timeout passes; its file is
    not removed meanwhile; a read that fails twice and then works is simply retried."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(4)})
    with dbsync.Receiver(root, reader_id="rdr", lease_timeout=5.0) as rx, rx.open() as snap:
        slot = snap.manifest.slot
        for code in (errno.EIO, errno.ESTALE):
            clock = Clock()
            flaky = LeaseMonitor(LeaseReadsFail(root, "rdr", code, failures=2), clock=clock)
            assert flaky.holders(slot) == ["rdr"]  # (retried within the same look)

            store = LeaseReadsFail(root, "rdr", code, failures=0)
            monitor = LeaseMonitor(store, clock=clock)
            assert monitor.holders(slot) == ["rdr"]
            store.failures = None  # from now on the lease cannot be read
            assert monitor.holders(slot) == ["rdr"]  # as read last

            never = LeaseMonitor(LeaseReadsFail(root, "rdr", code), clock=clock)
            assert never.holders(slot) == ["rdr"]  # never read: holds every slot
            other = "b" if slot == "a" else "a"
            assert never.holders(other) == []  # (the other slot is empty: nothing to hold)

            # past the timeouts (its own 5 s; the longest a reader may set, for one never read)
            # and the grace
            clock.now += MAX_LEASE_TIMEOUT * (DEAD_LEASE_GRACE + 2)
            assert never.holders(slot) == [] and monitor.holders(slot) == []
            assert os.path.exists(os.path.join(root, "readers", "rdr.json"))  # not removed
        assert torch.equal(dict(snap.tensors())["w"], torch.ones(4))


class OpensFail(Store):
    """A store whose opens of files named ``name`` fail with ``code`` (until ``healed``)."""

    def __init__(self, root: str, name: str, code: int):
        super().__init__(root, create=False)
        self.name, self.code, self.healed = name, code, False

    def open_regular(self, parts: tuple[str, ...], *args: Any, **kwargs: Any) -> int:
        if not self.healed and parts[-1].startswith(self.name):
            raise OSError(self.code, os.strerror(self.code))
        return super().open_regular(parts, *args, **kwargs)


def test_reads_the_mount_fails_are_not_called_damage(root):
    """ESTALE or EIO from the mount on a shard, an index, a stamp or the head: before, the
    version was "damaged ... publish again" (and recorded as refused, so the trainer's
    ``wait_for_receivers`` failed), an unreadable stamp ended in "the head changed 100 times
    ... a writer publishing in a tight loop?", others were bare OSErrors. Now each says the
    mount failed the read and names the file; nothing is recorded; the next load, once the
    mount works, applies the version exactly."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.arange(8.0)})
    cases = [("shard-", errno.ESTALE, "shard-00000.bin"), ("shard-", errno.EIO, "shard-00000"),
             ("index.json", errno.EIO, "index.json"),
             ("dbsync-slot.json", errno.ESTALE, "dbsync-slot.json"),
             ("dbsync.json", errno.ESTALE, "dbsync.json")]
    for name, code, named in cases:
        with dbsync.Receiver(root, reader_id="rdr") as rx:
            rx.store = faulty = OpensFail(root, name, code)
            got: dict[str, torch.Tensor] = {}
            try:
                rx.load(lambda pairs, got=got: got.update((n, t.clone()) for n, t in pairs))
            except dbsync.StoreUnreachableError as exc:
                assert exc.errno == code and named in str(exc), (name, str(exc))
                assert "mount" in str(exc) and "publish again" not in str(exc)
            else:
                raise AssertionError(f"a load with {name} failing returned")
            assert not got
            assert (Store(root).read_lease("rdr") or {}).get("refused") is None
            faulty.healed = True
            assert rx.load(lambda pairs, got=got: got.update(
                (n, t.clone()) for n, t in pairs)) == 1
            assert torch.equal(got["w"], torch.arange(8.0))


def test_a_record_replaced_between_open_and_read_is_opened_again(root, monkeypatch):
    """NFS says ESTALE when a file opened a moment ago was replaced by another host before it
    is read: the writer's atomic flip of the head, which happens on every push. Readers took
    it for a failed mount (`StoreUnreachableError` "check the mount"): 25 of ~2,200 loads in
    30 s through an NFS-like FUSE view with a push every 0.1 s. The head is now opened again
    (and reads the new version); a read that keeps failing is still the mount's failure."""
    from dbsync import fileio, store

    stale: dict[str, Any] = {"left": 0, "push": True, "writing": False}
    read_to_end = fileio.read_to_end

    def stale_head(fd: int, bound: int) -> bytes:
        if (os.readlink(f"/proc/self/fd/{fd}").endswith("dbsync.json") and stale["left"]
                and not stale["writing"]):
            stale["left"] -= 1
            if stale["push"]:  # (another host: the head replaced between open and read)
                stale["writing"] = True
                with dbsync.Sender(root) as writer:
                    writer.push({"w": torch.full((4,), float(writer.next_version))})
                stale["writing"] = False
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return read_to_end(fd, bound)

    monkeypatch.setattr(fileio, "read_to_end", stale_head)
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.full((4,), 1.0)})
    with dbsync.Receiver(root) as rx:
        stale["left"] = store.STALE_REOPENS
        out = {"w": torch.zeros(4)}
        version = rx.load(out)
        assert stale["left"] == 0 and version == 1 + store.STALE_REOPENS
        assert torch.equal(out["w"], torch.full((4,), float(version)))

        stale.update(left=10**6, push=False)  # every read fails: the mount's failure
        try:
            rx.load(out)
        except dbsync.StoreUnreachableError as exc:
            assert exc.errno == errno.ESTALE and "mount" in str(exc)
        else:
            raise AssertionError("a head that can never be read was loaded")
        assert torch.equal(out["w"], torch.full((4,), float(version)))  # nothing applied


def test_a_shard_size_the_mount_cached_is_looked_at_again(root, monkeypatch):
    """The writer resizes a slot's shard files when the tensors' sizes change; a FUSE mount
    (or NFS without close-to-open) reports a file's size from its attribute cache for up to
    a second after that. Loads failed with ``DamagedVersionError`` ("shard 0: has 131072
    bytes, expected 196608") for an intact current version: 1-5 times per reader in 30 s of
    a push every 0.1 s with changing sizes, through an NFS-like FUSE view with 1 s attribute
    caching. The size is now looked at again over the time such a cache lasts; a shard
    that stays the wrong size is still damage, and nothing is applied."""
    from dbsync import fileio

    cached = {"left": 0, "size": 0}
    fstat = os.fstat

    def cached_size(fd: Any, *args: Any, **kwargs: Any) -> Any:
        st = fstat(fd, *args, **kwargs)
        if (isinstance(fd, int) and cached["left"]
                and "shard-" in os.readlink(f"/proc/self/fd/{fd}")):
            cached["left"] -= 1
            return os.stat_result((*st[:6], cached["size"], *st[7:]))
        return st

    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.full((1024,), 1.0)})
        sender.push({"w": torch.full((4096,), 2.0)})  # (the other slot)
        sender.push({"w": torch.full((2048,), 3.0)})  # slot of version 1, its shard resized
    monkeypatch.setattr(fileio.os, "fstat", cached_size)
    with dbsync.Receiver(root) as rx:
        cached.update(left=2, size=1024 * 4)  # the size of version 1's shard, twice
        out = {"w": torch.zeros(2048)}
        assert rx.load(out) == 3 and cached["left"] == 0
        assert torch.equal(out["w"], torch.full((2048,), 3.0))

        cached.update(left=10**6)  # a shard that stays the wrong size: damage
        out["w"].zero_()
        try:
            rx.load(out)
        except dbsync.DamagedVersionError as exc:
            assert "has 4096 bytes, expected 8192" in str(exc)
        else:
            raise AssertionError("a shard of the wrong size was loaded")
        assert not out["w"].any()  # nothing applied


def test_files_an_nfs_client_keeps_busy_do_not_stop_a_push(root, monkeypatch, caplog):
    """On NFS a file unlinked while a process of the same client still maps it (a reader on
    the trainer's host, say) becomes ``.nfsXXXX`` until that process lets go, and unlinking
    it fails with ``EBUSY``. The writer, clearing a slot it reuses, unlinked every file it did
    not write and failed the push on the first refusal. Such files are now left alone (the
    client removes them), and a file said to be busy is skipped with an INFO line."""
    import logging

    from dbsync.store import Store

    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.full((4,), 1.0)})
        sender.push({"w": torch.full((4,), 2.0)})
        slot_dir = Store(root).slot_dir(Store(root).require_manifest().slot)
        slot_dir = slot_dir[:-1] + ("a" if slot_dir.endswith("b") else "b")  # version 1's
        silly, busy = ".nfs000000000123abcd00000001", "shard-00007.bin"
        for name in (silly, busy):
            with open(os.path.join(slot_dir, name), "wb") as f:
                f.write(b"x" * 100)
        unlink = os.unlink

        def nfs_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if os.path.basename(str(path)) in (silly, busy):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
            unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", nfs_unlink)
        with caplog.at_level(logging.INFO, logger="dbsync"):
            assert sender.push({"w": torch.full((4,), 3.0)}) == 3
    with dbsync.Receiver(root) as rx:
        out = {"w": torch.zeros(4)}
        assert rx.load(out) == 3 and torch.equal(out["w"], torch.full((4,), 3.0))
    assert sorted(n for n in os.listdir(slot_dir) if n in (silly, busy)) == [silly, busy]
    busy_lines = [r for r in caplog.records if busy in r.getMessage()]
    assert len(busy_lines) == 1 and busy_lines[0].levelno == logging.INFO


def test_a_shard_replaced_under_a_leaseless_copy_is_read_again(root, monkeypatch):
    """NFS answers ESTALE to a reader copying a shard that the writer, reusing the slot,
    replaced meanwhile (a shard resized for a version of other tensor sizes): a leaseless
    reader's load failed with `StoreUnreachableError` "the store's mount or disk failed this
    read" for that ordinary race, 11 of 13 loads of 48 MB through an NFS-like FUSE view with a
    push every ~0.3 s. The slot's stamp now says whether the writer moved on: if it did, the
    load reads again (the newest version); if not, the mount's failure is said as before."""
    from dbsync import fileio

    stale: dict[str, Any] = {"left": 0, "push": True}
    preadv = os.preadv

    def stale_shard(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if stale["left"] and "shard-" in os.readlink(f"/proc/self/fd/{fd}"):
            stale["left"] -= 1
            if stale["push"]:  # (the writer reuses the slot being copied)
                with dbsync.Sender(root) as writer:
                    for _ in range(2):
                        writer.push({"w": torch.full((8,), float(writer.next_version))})
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return preadv(fd, buffers, offset, *args)

    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.full((4,), 1.0)})
    monkeypatch.setattr(fileio.os, "preadv", stale_shard)
    with dbsync.Receiver(root, read_only=True) as rx:
        stale["left"] = 1
        got: dict[str, Any] = {}
        version = rx.load(lambda pairs: got.update((n, t.clone()) for n, t in pairs))
        assert stale["left"] == 0 and version == 3
        assert torch.equal(got["w"], torch.full((8,), 3.0))

        stale.update(left=10**6, push=False)  # the slot did not move: the mount's failure
        try:
            rx.load(lambda pairs: got.update(pairs))
        except dbsync.StoreUnreachableError as exc:
            assert exc.errno == errno.ESTALE and "mount" in str(exc)
        else:
            raise AssertionError("a shard that can never be read was loaded")
