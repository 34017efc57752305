"""SIGKILL campaign: a real writer process appends durably (several contexts, forks, batches,
payloads from 40 B to ~1 MB incompressible) and is killed with SIGKILL at random moments,
round after round on the same store.  After every kill the store must open, hold every
acknowledged turn with its payload, keep heads on existing turns at or after the last
acknowledged one with consistent depths, and pass fsck.  scripts/soak_store.py is the long
variant (`--rounds`); this test runs the same code for a bounded number of rounds.

The same campaign runs a few rounds in the non-durable bulk mode, whose promise is that a
process crash loses nothing.  A SIGKILL cannot reveal a missing fsync (the page cache
survives the process), so the last test cuts the power in a model: it records what each
fsync made durable and opens that.
"""
from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import blake3
import pytest

from store import Store, TurnInput
from store.fsck import fsck
from store.types import NO_TURN

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak_store.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_store", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_store"] = mod
    spec.loader.exec_module(mod)
    return mod


ROUNDS = 16


def test_sigkill_campaign_loses_no_acknowledged_turn(soak, tmp_path: Path) -> None:
    path = tmp_path / "store"
    rng = random.Random(2026)
    acked = soak.Acked()
    hows = []
    for _ in range(ROUNDS):
        _n, how = soak.one_round(path, rng, acked)
        hows.append(how)
        soak.verify(path, acked)  # raises with the turn or context that went wrong
    # the campaign really ran: thousands of acknowledged durable appends, both kinds of kill
    assert len(acked.turns) >= 2000, f"only {len(acked.turns)} appends were acknowledged"
    assert {"after appends", "on a timer"} <= set(hows)
    assert acked.forks > 0 and acked.large > 0, "the mix lacked forks or ~1 MB payloads"
    report = fsck(path, full=True)  # re-hashes every blob in the pack
    assert report.ok, report.summary()


def test_sigkill_in_bulk_mode_loses_nothing_acknowledged(soak, tmp_path: Path) -> None:
    """The non-durable bulk mode skips fsync, which only a power cut or OS crash can punish:
    after a process kill every acknowledged turn must still be there (StoreConfig's promise)."""
    path = tmp_path / "store"
    rng = random.Random(31)
    acked = soak.Acked()
    for _ in range(4):
        soak.one_round(path, rng, acked, durable=False)
        soak.verify(path, acked)
    assert len(acked.turns) >= 200


# --- power cut: only what was fsynced survives ----------------------------------------------


class DurableShadow:
    """What a power cut would leave of one store directory, under a simple model: a file's
    bytes are durable as of its last fsync/fdatasync; creating, renaming, truncating and
    deleting files are durable at once (optimistic about metadata, strict about data).
    SIGKILL cannot find a missing fsync (the page cache survives it); this can."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.names: dict[int, str] = {}  # tracked fd -> file name in root
        self.durable: dict[str, bytes] = {}

    def _name(self, path) -> str | None:
        p = Path(path).resolve()
        return p.name if p.parent == self.root else None

    def install(self, mp: pytest.MonkeyPatch) -> None:
        calls = ("open", "close", "fsync", "fdatasync", "replace", "unlink", "ftruncate")
        real = {f: getattr(os, f) for f in calls}

        def open_(path, flags, mode=0o777, *args, **kw):
            fd = real["open"](path, flags, mode, *args, **kw)
            name = self._name(path)
            if name is not None and not flags & os.O_DIRECTORY:
                self.names[fd] = name
                if flags & os.O_TRUNC or name not in self.durable:
                    self.durable[name] = b""
            return fd

        def close(fd):
            self.names.pop(fd, None)
            real["close"](fd)

        def sync(which):
            def f(fd):
                real[which](fd)
                if fd in self.names:
                    self.durable[self.names[fd]] = (self.root / self.names[fd]).read_bytes()
            return f

        def replace(src, dst, *args, **kw):
            real["replace"](src, dst, *args, **kw)
            s, d = self._name(src), self._name(dst)
            if s is not None and d is not None:
                self.durable[d] = self.durable.pop(s, b"")

        def unlink(path, *args, **kw):
            real["unlink"](path, *args, **kw)
            name = self._name(path)
            if name is not None:
                self.durable.pop(name, None)

        def ftruncate(fd, n):
            real["ftruncate"](fd, n)
            if fd in self.names:
                data = self.durable[self.names[fd]]
                self.durable[self.names[fd]] = data[:n].ljust(n, b"\0")

        for name, fn in (("open", open_), ("close", close), ("fsync", sync("fsync")),
                         ("fdatasync", sync("fdatasync")), ("replace", replace), ("unlink", unlink),
                         ("ftruncate", ftruncate)):
            mp.setattr(os, name, fn)

    def image(self, dest: Path) -> None:
        dest.mkdir()
        for name, data in self.durable.items():
            (dest / name).write_bytes(data)


def test_power_cut_keeps_acknowledged_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "live"
    root.mkdir()
    shadow = DurableShadow(root)
    shadow.install(monkeypatch)
    rng = random.Random(11)
    st = Store.open(root)
    heads = {st.create_context().context_id: NO_TURN for _ in range(3)}
    acked: dict[int, bytes] = {}
    cuts = 0
    for i in range(240):
        if i % 40 == 39:  # a fork, acknowledged like an append
            heads[st.fork(rng.choice(list(acked))).context_id] = NO_TURN
        ctx = rng.choice(list(heads))
        size = rng.choice([50, 900, 6000, 300_000]) if i % 30 else 1 << 20
        payload = rng.randbytes(size) if size > 100_000 else (b"line %d " % i) * (size // 8)
        t = st.append_turn(ctx, payload)
        acked[t.turn_id] = blake3.blake3(payload).digest()
        heads[ctx] = t.turn_id
        if i % 20 == 19:  # cut the power now: open what the disk would hold
            cuts += 1
            img = tmp_path / f"cut{i}"
            shadow.image(img)
            cut = Store.open(img)
            try:
                for tid, h in acked.items():
                    assert cut.get_turn(tid).payload_hash == h, f"cut after append {i}: turn {tid}"
                    assert blake3.blake3(cut.get_blob(h)).digest() == h
                for c, head in heads.items():
                    got = cut.get_head(c).head_turn_id
                    on_chain = {x.turn_id for x in cut.chain(got)} if got != NO_TURN else set()
                    assert head == NO_TURN or head in on_chain, \
                        f"cut after append {i}: context {c} lost acknowledged turn {head}"
            finally:
                cut.close()
            report = fsck(img)
            assert report.ok, report.summary()
    st.close()
    assert cuts == 12


def test_power_cut_keeps_batches_whose_blobs_skip_the_wal(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An import's batches: many small new lines, more than BATCH_COPY_MAX of records, so the
    head WAL carries no copies and the pack is synced before it.  A power cut after any
    acknowledged batch keeps every one of its turns and blobs; the WAL stays small."""
    from store.api import BATCH_COPY_MAX
    from store.files.headwal import HeadWal

    root = tmp_path / "live"
    root.mkdir()
    shadow = DurableShadow(root)
    shadow.install(monkeypatch)
    wal_bytes = [0]
    append = HeadWal.append

    def counting(self: HeadWal, data: bytes) -> None:
        wal_bytes[0] += len(data)
        append(self, data)

    monkeypatch.setattr(HeadWal, "append", counting)
    rng = random.Random(5)
    st = Store.open(root)
    ctx = st.create_context().context_id
    acked: dict[int, bytes] = {}
    batch_bytes = 0
    for b in range(6):
        lines = [rng.randbytes(rng.randint(200, 3000)) for _ in range(300)]  # ~500 KB, incompressible
        batch_bytes += sum(map(len, lines))
        turns = st.append_turns(ctx, [TurnInput(x) for x in lines])
        acked.update({t.turn_id: t.payload_hash for t in turns})
        img = tmp_path / f"cut{b}"
        shadow.image(img)
        with Store.open(img) as cut:
            assert cut.get_head(ctx).head_turn_id == turns[-1].turn_id
            for tid, h in acked.items():
                assert cut.get_turn(tid).payload_hash == h, f"cut after batch {b}: turn {tid}"
                assert blake3.blake3(cut.get_blob(h)).digest() == h
        assert fsck(img).ok
    st.close()
    assert batch_bytes > 6 * BATCH_COPY_MAX and wal_bytes[0] < batch_bytes // 10
