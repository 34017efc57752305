"""Sharing under the sharer's control, in the library: `share --expires/--to`, the per-peer
check the provider makes per request, the audit log, `gc` and `rm` (real store, real Pi files)."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pifork import find

from p2pnode.errors import InvalidInput, NotFound
from p2pnode.library import access, audit
from p2pnode.library.api import Library
from p2pnode.library.audit import AuditLog, ServedAnswer
from p2pnode.paths import NodePaths
from store.fsck import fsck

A1 = "*0313-7475-8d45-88a780e9fa37.jsonl"  # root
A3 = "*173a-7744-89ad-bbc16c12cc22.jsonl"  # 1.4 MB, images
A6 = "*2810-72f3-bf21-ab15b19d413f.jsonl"  # pi --fork of A1
B5 = "*69ef-76bb-aaf0-d291c98d9fe0.jsonl"  # new_session{parentSession: B3}; B3 -> B2 -> B1
ALICE = "a" * 56
BOB = "b" * 56
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def agent(corpus_dir: Path, tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    return agent


def events(lib: Library, kind: str) -> list[dict]:
    return [e for e in lib.audit.read() if e["event"] == kind]


# --- expiry ---------------------------------------------------------------------------------


def test_expiry_durations_and_the_configured_default(tmp_path: Path) -> None:
    assert [access.parse_expires(t) for t in ("30m", "12h", "7d", "2w", "never", " 1D ")] == [
        1800, 43200, 604800, 1209600, None, 86400]
    for bad in ("", "7", "0d", "7y", "-1d", "1.5h", "d7"):
        with pytest.raises(InvalidInput, match="expiry"):
            access.parse_expires(bad)
    assert access.default_expires(tmp_path) == "never"  # no config file
    (tmp_path / "config.json").write_text('{"share_expires": "3d"}')
    assert access.default_expires(tmp_path) == "3d"
    assert access.expires_at(None, tmp_path, now_ms=1000) == 1000 + 3 * 86400 * 1000
    assert access.expires_at("never", tmp_path, now_ms=1000) is None
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(InvalidInput, match="config.json is not JSON"):
        access.default_expires(tmp_path)


@pytest.mark.parametrize(("config", "named"), [
    ('{"share_expires": "soon"}', "config.json: share_expires 'soon': a number and a unit"),
    ('{"share_expires": 7}', 'config.json: share_expires 7: a string like "7d"'),
    ('{"share_expires": null}', 'config.json: share_expires null: a string like "7d"'),
    ('{"share_expire": "7d"}', "config.json: unknown key 'share_expire' (the keys are share_expires)"),
    ('{"share_expires": "7d", "colour": "red"}', "config.json: unknown key 'colour'"),
    ('["share_expires", "7d"]', "config.json is not a JSON object of settings"),
])
def test_a_bad_config_names_the_file_the_key_and_the_value(tmp_path: Path, config: str, named: str) -> None:
    """Every key of config.json is checked the same way, whether or not the share uses it:
    a typo in a key is not silently a default, a bad value is not reported without its key."""
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(InvalidInput) as failed:
        access.default_expires(tmp_path)
    assert str(failed.value).startswith(str(tmp_path / "config.json")) and named in str(failed.value)


def test_default_expiry_from_the_config_applies_to_share(lib: Library, agent: Path) -> None:
    (lib.paths.home / "config.json").write_text('{"share_expires": "2h"}')
    before = int(time.time() * 1000)
    info = lib.share(str(find(agent, A1)))
    assert info.expires_at is not None
    assert before + 2 * 3600_000 <= info.expires_at <= int(time.time() * 1000) + 2 * 3600_000
    assert lib.share(str(find(agent, A1)), expires="never").expires_at is None


def test_expired_is_not_served_at_request_time_and_is_logged_once(
        lib: Library, agent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = lib.share(str(find(agent, A6)), expires="1h")
    parent = info.ancestors[0]
    refs = lib.line_manifest(info.src)
    assert lib.offered_object(info.branch, ALICE) == "sidecar"
    generation = lib.catalog(ALICE).generation
    later = info.expires_at + 1
    monkeypatch.setattr(access, "now_ms", lambda: later)  # no timer ran: the request itself sees it
    assert lib.offered_object(info.branch, ALICE) is None
    assert lib.offered_object(info.src, ALICE) is None
    assert lib.offered_object(refs[0].hash.hex(), ALICE) is None
    catalog = lib.catalog(ALICE)
    assert catalog.generation > generation and catalog.branches == []  # the lineage expired with it
    assert lib.branch(info.branch).withdrawn == "expired" and not lib.branch(info.branch).offered
    assert lib.branch(parent.branch).withdrawn == "expired"
    assert lib.expire_due() == []  # already done
    assert sorted(e["branch"] for e in events(lib, "expired")) == sorted([info.branch, parent.branch])
    assert {e["branch"]: e["title"] for e in events(lib, "expired")}[info.branch] == info.title
    again = lib.share(str(find(agent, A6)), expires="1h")  # sharing again offers it again
    assert lib.offered_object(again.branch, ALICE) == "sidecar" and again.withdrawn is None


def test_an_expired_lineage_is_offered_again_with_a_child(lib: Library, agent: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An ancestor keeps the longer of its own and its child's expiry, and every peer it had."""
    parent = lib.share(str(find(agent, A1)), expires="1h")
    child = lib.share(str(find(agent, A6)), expires="1d", to=[BOB])
    widened = lib.branch(parent.branch)
    assert widened.expires_at == child.expires_at and widened.to is None
    assert events(lib, "shared")[-1]["audience_changed"] == [  # the log says so
        {"branch": parent.branch, "to": None, "expires_at": child.expires_at}]
    monkeypatch.setattr(access, "now_ms", lambda: parent.expires_at + 1)
    assert lib.offered_object(parent.branch, ALICE) == "sidecar"  # the child's expiry holds it
    assert lib.offered_object(child.branch, ALICE) is None  # not named


# --- --to -------------------------------------------------------------------------------------


def test_to_offers_a_branch_and_its_lineage_only_to_the_peers_named(lib: Library, agent: Path) -> None:
    info = lib.share(str(find(agent, A6)), to=[ALICE, ALICE])
    assert info.to == [ALICE]
    parent = info.ancestors[0]
    for h in (info.branch, info.src, parent.branch, parent.src):
        assert lib.offered_object(h, ALICE) is not None
        assert lib.offered_object(h, BOB) is None
        assert lib.offered_object(h) is None  # "any trusted peer" (mDNS announcements) does not see it
    assert [b.branch for b in lib.catalog(ALICE).branches] == [info.branch, parent.branch]
    assert lib.catalog(BOB).branches == [] and lib.catalog().branches == []
    everyone = lib.share(str(find(agent, A6)))  # shared again without --to: every trusted peer
    assert everyone.to is None and lib.offered_object(info.branch, BOB) == "sidecar"


def test_a_fork_whose_parent_is_unshared_is_neither_listed_nor_served(lib: Library, agent: Path) -> None:
    """A peer without the parent could not fetch the fork's lineage: the catalog listed the fork
    all the same (exit 3 naming a hash the peer never asked for).  `unshare` says so, `ls` and
    `show` say why (BranchInfo.withheld), and sharing the parent again serves both."""
    fork = lib.share(str(find(agent, A6)))
    parent = fork.ancestors[0]
    done = lib.unshare(parent.branch[:12])
    assert done.branch.branch == parent.branch and [i.branch for i in done.withheld] == [fork.branch]
    assert lib.catalog(ALICE).branches == [] and lib.offered_object(fork.branch, ALICE) is None
    assert lib.offered_object(fork.src, ALICE) is None
    info = lib.branch(fork.branch)
    assert info.offered and f"its ancestor {parent.branch[:16]} is unshared" in (info.withheld or "")
    lib.share(str(find(agent, A1)))
    assert [b.branch for b in lib.catalog(ALICE).branches] == [parent.branch, fork.branch]
    assert lib.branch(fork.branch).withheld is None and lib.offered_object(fork.branch, ALICE) == "sidecar"


def test_versions_of_a_session_are_unshared_and_narrowed_together(lib: Library, agent: Path) -> None:
    """`ls` shows a session as one row, its latest version: `unshare` or `share --to` of that row
    left the older versions, holding the same bytes, offered to everyone."""
    path = find(agent, A1)
    v1 = lib.share(str(path))
    with open(path, "ab") as f:
        f.write(b'{"type":"custom","id":"c0ffee01","parentId":null,"data":{}}\n')
    v2 = lib.share(str(path))
    done = lib.unshare(v2.branch)
    assert done.versions == [v1.branch] and not lib.branch(v1.branch).offered
    assert lib.catalog(ALICE).branches == [] and lib.offered_object(v1.src, ALICE) is None
    assert [e["branch"] for e in events(lib, "unshared")] == [v2.branch, v1.branch]
    lib.share(str(path))  # v2 again, to everyone
    with open(path, "ab") as f:
        f.write(b'{"type":"custom","id":"c0ffee02","parentId":null,"data":{}}\n')
    v3 = lib.share(str(path), to=[ALICE])
    assert events(lib, "shared")[-1]["audience_changed"] == [
        {"branch": v2.branch, "to": [ALICE], "expires_at": None}]  # v2 went to everyone
    assert lib.offered_object(v3.src, BOB) is None and lib.offered_object(v2.src, BOB) is None
    assert lib.offered_object(v2.src, ALICE) == "session" and lib.branch(v2.branch).to == [ALICE]
    # a version shared --to a peer is the base of its growth's short manifest for that peer alone
    assert lib.line_manifest_after(v3.src, [v2.src], ALICE) == (v2.src, lib.version(v2.src).lines)
    assert lib.line_manifest_after(v3.src, [v2.src], BOB) is None
    assert lib.unshare(v3.branch).versions == [v2.branch]  # v1 was unshared already: no event again
    assert [e["branch"] for e in events(lib, "unshared")][2:] == [v3.branch, v2.branch]


def test_a_branch_without_a_clean_scan_record_is_not_served(agent: Path, tmp_path: Path) -> None:
    """The node re-checks before serving: a version whose scan found secrets is refused; one
    with no record (shared before scans were recorded) is scanned first (tests/library/test_upgrade.py)."""
    paths = NodePaths(tmp_path / "node")
    with Library.open(paths, agent_dir=agent) as lib:
        info = lib.share(str(find(agent, A1)))
        assert lib.offered_object(info.branch, ALICE) == "sidecar"
    scanned = paths.home / "scanned.json"
    record = json.loads(scanned.read_bytes())
    record[info.src] = [{"kind": "openai", "masked": "sk-…", "line": 3, "entry": "message", "where": "x",
                         "start": 0, "end": 4}]
    scanned.write_text(json.dumps(record))
    with Library.open(paths, agent_dir=agent) as lib:
        assert lib.offered_object(info.branch, ALICE) is None and lib.catalog(ALICE).branches == []
    scanned.unlink()  # as a node before scans were recorded: scanned on the first request, clean
    with Library.open(paths, agent_dir=agent) as lib:
        assert lib.offered_object(info.branch, ALICE) == "sidecar"
    assert json.loads(scanned.read_bytes())[info.src] == []


def test_listeners_hear_of_unshare_and_expiry(lib: Library, agent: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    heard: list[int] = []
    lib.add_listener(lambda: heard.append(1))
    info = lib.share(str(find(agent, A1)), expires="30m")
    lib.unshare(info.branch)
    assert len(heard) == 2
    info = lib.share(str(find(agent, A1)), expires="30m")
    monkeypatch.setattr(access, "now_ms", lambda: info.expires_at)
    assert lib.expire_due() == [info.branch] and len(heard) == 4


# --- the audit log ------------------------------------------------------------------------------


def test_every_event_is_logged(lib: Library, agent: Path, tmp_path: Path) -> None:
    info = lib.share(str(find(agent, A6)), to=[ALICE], expires="7d")
    shared = events(lib, "shared")[-1]
    assert shared["branch"] == info.branch and shared["to"] == [ALICE]
    assert shared["expires_at"] == info.expires_at and shared["lineage"] == [info.ancestors[0].branch]
    assert shared["audience_changed"] == []  # nothing was offered before
    lib.record_served([ServedAnswer(ALICE, "alice", "batch", (info.src, "f" * 64), 1234)])
    served = events(lib, "served")[-1]
    assert served["peer"] == ALICE and served["peer_name"] == "alice" and served["bytes"] == 1234
    assert served["branches"] == [info.branch]
    lib.unshare(info.branch)
    assert events(lib, "unshared")[-1]["branch"] == info.branch
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=agent) as other:
        data = find(agent, A1).read_bytes()
        sidecar = lib.sidecar_bytes(info.ancestors[0].branch)
        other.add_fetched(sidecar, data.splitlines(keepends=True))
        fetched = events(other, "fetched")[-1]
        assert fetched["branch"] == info.ancestors[0].branch and fetched["bytes"] == len(data)
    assert [e["event"] for e in lib.audit.read()] == ["shared", "served", "unshared"]


def test_the_log_is_bounded_and_survives_a_torn_line(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log", max_bytes=4096)
    for i in range(400):
        log.append("served", peer=ALICE, bytes=i)
    assert log.path.stat().st_size <= 4096 + 200 and log.older.stat().st_size <= 4096 + 200
    kept = [e["bytes"] for e in log.read()]
    assert kept == list(range(400 - len(kept), 400)) and len(kept) > 20
    with open(log.path, "ab") as f:
        f.write(b'{"time":1,"event":"shar')  # a crash in the middle of an append
    assert [e["bytes"] for e in log.read()] == kept
    log.append("unshared", branch="c" * 64)
    assert log.read()[-1]["branch"] == "c" * 64 and [e["bytes"] for e in log.read()[:-1]] == kept
    assert oct(log.path.stat().st_mode & 0o777) == "0o600"


def test_many_events_take_one_write_and_one_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fetch's many batch answers cost the serving node: one fsync for those that came
    while the previous one was written, not one each; a torn last line stays its own line."""
    log = AuditLog(tmp_path / "audit.log")
    log.append("served", peer=ALICE, bytes=0)
    with open(log.path, "ab") as f:
        f.write(b'{"time":1,"event":"ser')  # a crash in the middle of an append
    flushes: list[int] = []
    monkeypatch.setattr(audit, "flush_data", flushes.append)
    log.append_many([("served", {"peer": ALICE, "bytes": i}) for i in range(1, 50)])
    assert len(flushes) == 1
    assert [e["bytes"] for e in log.read()] == list(range(50))


# --- gc and rm --------------------------------------------------------------------------------------


def test_gc_reclaims_unshared_and_keeps_what_is_live(lib: Library, agent: Path) -> None:
    big = lib.share(str(find(agent, A3)))
    keep = lib.share(str(find(agent, A6)))
    lib.store.checkpoint()
    assert lib.space()["reclaimable_bytes"] == 0
    assert lib.gc().branches == []  # nothing to do
    lib.unshare(big.branch)
    space = lib.space()
    assert space["reclaimable_bytes"] > 1_000_000  # the images, compressed as stored
    pack = lib.paths.store / "blobs.pack"
    pack_before = pack.stat().st_size
    report = lib.gc()
    assert report.branches == [big.branch] and report.versions == [big.src]
    assert pack.stat().st_size < pack_before - 1_000_000
    # the data files: not the head WAL's 1 MiB generations, which checkpoints make and remove;
    # the store shrinks by what was freed and those blobs' index entries (README, "Space")
    assert report.store_bytes_before - report.store_bytes_after >= report.bytes_freed
    assert report.store_bytes_after == sum(f.stat().st_size for f in lib.paths.store.iterdir()
                                           if not f.name.startswith("heads.wal"))  # the index: written whole
    assert report.bytes_freed == space["reclaimable_bytes"]  # what `status` said gc would free
    assert lib.space()["reclaimable_bytes"] == 0
    assert not lib.has_branch(big.branch) and lib.manifest.get(big.branch) is None
    assert lib.session_bytes(keep.src) == find(agent, A6).read_bytes()
    assert lib.session_bytes(keep.ancestors[0].src) == find(agent, A1).read_bytes()
    assert events(lib, "gc")[-1]["branches"] == [big.branch]
    assert events(lib, "reclaimed")[-1]["bytes"] == report.bytes_freed


def test_gc_figures_agree_with_status_and_never_show_the_store_grown(lib: Library, agent: Path) -> None:
    """A small session unshared right after its share (its lines still raw in the head WAL, the
    blob index not written yet): `status`'s figures are the ones `gc` starts from, it frees
    what `status` estimated, and the store shrinks by that and the index entries of those
    lines (it showed 11291 -> 11355 bytes, "freed 0", then)."""
    branch = lib.share(str(find(agent, A1))).branch
    lib.unshare(branch)
    status = lib.space()
    report = lib.gc()
    assert report.bytes_freed == status["reclaimable_bytes"] > 0
    assert abs(report.store_bytes_before - status["store_bytes"]) < 512  # the head table, snapshotted by gc
    shrink = report.store_bytes_before - report.store_bytes_after
    assert report.bytes_freed <= shrink < 2 * report.bytes_freed + 512  # an index entry < its record
    assert lib.space()["store_bytes"] == report.store_bytes_after
    again = lib.gc()  # nothing to free: the store does not grow
    assert again.bytes_freed == 0 and again.store_bytes_after <= again.store_bytes_before + 256


def test_status_figures_write_nothing_and_count_what_is_not_packed_yet(lib: Library, agent: Path) -> None:
    """`status` (Library.space) is a read: the lines a share left raw in the head WAL stay
    there (it packed them: a write, refused by a read-only store), and are counted as the pack
    will hold them, so the figures are the same before and after they are packed."""
    lib.unshare(lib.share(str(find(agent, A1))).branch)
    files = {f.name: f.read_bytes() for f in lib.paths.store.iterdir() if f.is_file()}
    unpacked = lib.store.unpacked_bytes
    assert unpacked > 0  # the premise: the share's lines wait raw for the next checkpoint
    space = lib.space()
    assert {f.name: f.read_bytes() for f in lib.paths.store.iterdir() if f.is_file()} == files
    assert lib.store.unpacked_bytes == unpacked
    lib.store.pack_pending()
    assert lib.store.unpacked_bytes == 0 and lib.space() == space


def test_a_gc_interrupted_in_the_store_gc_has_logged_what_it_forgot(lib: Library, agent: Path) -> None:
    """Ctrl-C once the records are saved: the branches are forgotten, so the `gc` event is
    there (it was written after the store's GC: a forgotten branch never reached the log)."""
    big = lib.share(str(find(agent, A3)))
    lib.unshare(big.branch)

    def interrupt(phase: str) -> None:
        if phase not in ("records-saved", "contexts-deleted"):  # the store's first phase
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lib.gc(interrupt)
    assert not lib.has_branch(big.branch)
    assert events(lib, "gc")[-1]["branches"] == [big.branch] and events(lib, "reclaimed") == []
    assert lib.gc().bytes_freed > 1_000_000  # the next gc frees the bytes
    assert events(lib, "reclaimed")[-1]["bytes"] > 1_000_000


def test_gc_keeps_fetched_sessions_and_ancestors_of_kept_branches(lib: Library, agent: Path,
                                                                 tmp_path: Path) -> None:
    child = lib.share(str(find(agent, A6)))
    parent = child.ancestors[0]
    lib.unshare(parent.branch)  # still the parent of an offered branch
    assert lib.gc().branches == []
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=agent) as other:
        data = find(agent, A1).read_bytes()
        fetched = other.add_fetched(lib.sidecar_bytes(parent.branch), data.splitlines(keepends=True))
        assert other.unshare(fetched.branch).branch.withdrawn is None  # nothing to unshare: still kept
        assert other.gc().branches == [] and other.session_bytes(fetched.src) == data


def test_rm_forgets_a_branch_or_a_session_id(lib: Library, agent: Path) -> None:
    child = lib.share(str(find(agent, A6)))
    parent = child.ancestors[0]
    with pytest.raises(InvalidInput, match="has it as its parent"):
        lib.remove(parent.branch)
    removed = lib.remove(child.branch[:12])
    assert [i.branch for i in removed] == [child.branch] and removed[0].offered
    assert not lib.has_branch(child.branch) and lib.offered_object(child.branch, ALICE) is None
    assert lib.manifest.get(child.branch) is None
    assert events(lib, "removed")[-1]["branch"] == child.branch
    session_id = parent.header["id"]
    other = lib.share(str(find(agent, A3)))
    with pytest.raises(NotFound, match="matches 2 sessions"):  # 01a1ff93-0313-… and 01a1ff93-173a-…
        lib.remove(session_id[:8])
    assert [i.branch for i in lib.remove(session_id[:13].upper())] == [parent.branch]  # as `share` takes it
    with pytest.raises(NotFound):
        lib.remove(parent.branch)
    assert [i.branch for i in lib.remove(other.header["id"][:8])] == [other.branch]  # now the only one
    freed = lib.gc()
    assert freed.bytes_freed > 0 and lib.branches(include_unshared=True) == []
    assert lib.store.list_contexts() == []


def test_gc_is_skipped_while_a_fetch_holds_a_lease_and_a_fetch_waits_for_gc(lib: Library,
                                                                            agent: Path) -> None:
    big = lib.share(str(find(agent, A3)))
    lib.unshare(big.branch)
    assert lib.leases.try_acquire()
    report = lib.gc()
    assert report.skipped and report.branches == [] and lib.has_branch(big.branch)
    lib.leases.release()
    started = threading.Event()
    order: list[str] = []

    def fetch() -> None:
        started.wait()
        while not lib.leases.try_acquire():  # until the GC below has finished
            time.sleep(0.01)
        order.append("fetch")
        lib.leases.release()

    t = threading.Thread(target=fetch)
    t.start()
    lib.gc(on_phase=lambda name: (started.set(), time.sleep(0.05), order.append(name)))
    t.join(10)
    assert order[-1] == "fetch" and "index-swapped" in order


GC_CHILD = """
import os, random, signal, sys
from pathlib import Path
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
home, agent, at = sys.argv[1], sys.argv[2], sys.argv[3]
def on_phase(name):
    if name == at:
        os.kill(os.getpid(), signal.SIGKILL)
lib = Library.open(NodePaths(Path(home)), agent_dir=Path(agent))
print("open", flush=True)
lib.gc(on_phase=on_phase)
print("done", flush=True)
"""


def _setup_garbage(lib: Library, agent: Path) -> dict[str, bytes]:
    """Live sessions (by src: their bytes) and garbage: unshared, removed, superseded."""
    live = {}
    for name in (A6, B5):
        info = lib.share(str(find(agent, name)))
        for i in [info, *info.ancestors]:
            live[i.src] = lib.session_bytes(i.src)
    big = lib.share(str(find(agent, A3)))
    lib.unshare(big.branch)
    return live


def _check_live(home: Path, agent: Path, live: dict[str, bytes]) -> None:
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        for src, data in live.items():
            assert lib.session_bytes(src) == data
        for info in lib.branches():
            assert lib.session_bytes(info.src) == live[info.src]
        lib.gc()  # a GC run to the end afterwards still works, and keeps them
        for src, data in live.items():
            assert lib.session_bytes(src) == data
    report = fsck(home / "store", full=True)
    assert report.ok, report.errors


@pytest.mark.parametrize("phase", ["records-saved", "contexts-deleted", "marked", "new-pack-written",
                                   "pack-swapped", "index-swapped"])
def test_gc_killed_at_each_step_leaves_every_live_session_readable(agent: Path, tmp_path: Path,
                                                                   phase: str) -> None:
    home = tmp_path / "node"
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        live = _setup_garbage(lib, agent)
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(home), str(agent), phase], cwd=REPO,
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    _check_live(home, agent, live)


def test_gc_killed_at_random_moments_leaves_every_live_session_readable(agent: Path, tmp_path: Path) -> None:
    rnd = random.Random(int(os.environ.get("P2PNODE_TEST_SEED", "15")))
    home = tmp_path / "node"
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        live = _setup_garbage(lib, agent)
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", GC_CHILD, str(home), str(agent), "-"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"open\n"
        time.sleep(rnd.uniform(0, 0.09))  # this GC takes about 80 ms here (records, mark, sweep, swaps)
        proc.kill()
        proc.wait(30)
        _check_live(home, agent, live)
        with Library.open(NodePaths(home), agent_dir=agent) as lib:  # garbage again for the next round
            lib.unshare(lib.share(str(find(agent, A3))).branch)


def test_gc_removes_what_killed_fetches_left_in_the_staging_dir(lib: Library) -> None:
    """A fetch killed mid-way leaves its temp session file (as large as what it had written)
    and its kept line manifest and batch format measures in <home>/fetching; GC, which runs
    only while no fetch does, removes the temp files and the kept files older than the GC
    grace (a younger one still saves a rerun its manifest, its tries of the formats)."""
    from p2pnode.peer.get import KeptManifests

    staging = lib.paths.fetching
    staging.mkdir(mode=0o700, exist_ok=True)
    temp = staging / f".p2pnode-{'ab' * 8}.4242.tmp"
    temp.write_bytes(b"x" * 5000)
    kept = KeptManifests(staging)
    old, young = kept.path("c" * 64), kept.path("d" * 64)
    old_pace, young_pace = kept.pace_path("c" * 64), kept.pace_path("d" * 64)
    for path, size in ((old, 300), (young, 200), (old_pace, 40), (young_pace, 30)):
        path.write_bytes(b"m" * size)
    hours_ago = time.time() - 2 * 3600
    for path in (old, old_pace):
        os.utime(path, (hours_ago, hours_ago))
    assert lib.leases.try_acquire()  # a fetch runs: nothing is touched
    assert lib.gc().skipped and temp.exists() and old.exists() and old_pace.exists()
    lib.leases.release()
    report = lib.gc()
    assert not temp.exists() and not old.exists() and not old_pace.exists()
    assert young.exists() and young_pace.exists()
    assert report.staging_bytes_freed == 5340
