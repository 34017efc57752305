"""The store on real failing block devices (marker `root`: needs root, loop devices, mount,
and for the second test the kernel's device-mapper).

- A full disk: a small ext4 file system on a loop device, filled up while the store appends.
  The kernel's own ENOSPC must fail the store closed (StoreFull), lose nothing acknowledged,
  and after space is freed and the store reopened, appends work again.
- A dying disk: ext4 on a device-mapper device whose table is switched from `linear` to
  `error` under the running store.  The next append's flush gets the kernel's EIO: the store
  fails closed.  The table is switched back, the file system unmounted (dropping the page
  cache), checked and mounted again, and every acknowledged turn must be there.

Each skips only with the precise reason: not root, or loop devices or device-mapper
unavailable in this kernel (a missing tool fails: .ci/run installs them).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from skips import KERNEL_LIMITATION

from store import Store, StoreFailed, StoreFull
from store.fsck import fsck

pytestmark = pytest.mark.root

SECTOR = 512


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def _need(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (loop devices, mount, device-mapper)")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: .ci/run installs it")


@contextmanager
def _loop(image: Path, size: int) -> Iterator[str]:
    with open(image, "wb") as f:
        f.truncate(size)
    try:
        dev = _run("losetup", "-f", "--show", str(image))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"{KERNEL_LIMITATION}no loop device in this kernel or container: {exc.stderr.strip()}")
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False, timeout=60)


@contextmanager
def _mounted(dev: str, at: Path) -> Iterator[Path]:
    at.mkdir(exist_ok=True)
    _run("mount", "-o", "errors=continue", dev, str(at))
    try:
        yield at
    finally:
        if subprocess.run(["umount", str(at)], check=False, timeout=60).returncode:
            subprocess.run(["umount", "-l", str(at)], check=False, timeout=60)  # never left mounted


def _check(path: Path, acked: dict[int, bytes], ctx: int) -> None:
    with Store.open(path) as s:
        for tid, payload in acked.items():
            assert s.payloads([s.get_turn(tid)]) == [payload], f"acknowledged turn {tid} lost"
        head = s.get_head(ctx).head_turn_id
        assert head in acked, f"head {head} was never acknowledged"
        s.append_turn(ctx, b"after recovery")
    report = fsck(path)
    assert report.ok, report.summary()


def test_full_disk_fails_closed(tmp_path: Path) -> None:
    _need("losetup", "mkfs.ext4", "mount", "umount")
    with _loop(tmp_path / "disk.img", 16 << 20) as dev:
        _run("mkfs.ext4", "-q", "-F", "-m", "0", dev)
        with _mounted(dev, tmp_path / "mnt") as mnt:
            filler = mnt / "filler"  # freed after the failure: recovery needs room for a new WAL
            filler.write_bytes(bytes(4 << 20))
            path = mnt / "store"
            acked: dict[int, bytes] = {}
            s = Store.open(path)
            ctx = s.create_context().context_id
            with pytest.raises(StoreFull) as info:
                for i in range(10_000):  # bounded: 16 MiB fill up long before
                    payload = os.urandom(40_000) + b"%d" % i  # incompressible
                    acked[s.append_turn(ctx, payload).turn_id] = payload
            assert len(acked) > 10
            assert "No space left" in str(info.value)
            with pytest.raises(StoreFailed):
                s.create_context()
            assert s.get_head(ctx).head_turn_id == max(acked)  # the refused turn moved no head
            s.close()
            filler.unlink()
            _check(path, acked, ctx)


DM_NAME = f"p2pnode-test-{os.getpid()}"


def _device_mapper() -> None:
    _need("losetup", "mkfs.ext4", "mount", "umount", "dmsetup", "e2fsck")
    probe = subprocess.run(["dmsetup", "version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or not Path("/dev/mapper/control").exists():
        said = probe.stderr.strip().splitlines()
        why = said[0] if said else f"dmsetup version exited {probe.returncode}"
        pytest.skip(f"{KERNEL_LIMITATION}device-mapper is unavailable in this kernel "
                    f"(no /dev/mapper/control): {why}")


def _table(dev: str, target: str) -> str:
    sectors = int(_run("blockdev", "--getsz", dev))
    return f"0 {sectors} linear {dev} 0" if target == "linear" else f"0 {sectors} error"


def _switch(dev: str, target: str) -> None:
    _run("dmsetup", "suspend", "--noflush", DM_NAME)
    _run("dmsetup", "load", DM_NAME, "--table", _table(dev, target))
    _run("dmsetup", "resume", DM_NAME)


def test_dm_error_fails_closed(tmp_path: Path) -> None:
    _device_mapper()
    with _loop(tmp_path / "disk.img", 32 << 20) as dev:
        _run("dmsetup", "create", DM_NAME, "--table", _table(dev, "linear"))
        mapped = f"/dev/mapper/{DM_NAME}"
        try:
            _run("mkfs.ext4", "-q", "-F", mapped)
            acked: dict[int, bytes] = {}
            with _mounted(mapped, tmp_path / "mnt") as mnt:
                path = mnt / "store"
                s = Store.open(path)
                ctx = s.create_context().context_id
                for i in range(20):
                    payload = b"turn %d " % i * 50
                    acked[s.append_turn(ctx, payload).turn_id] = payload
                _switch(dev, "error")
                with pytest.raises(StoreFailed) as info:
                    for i in range(100):  # the first flush to reach the device fails
                        payload = b"doomed %d " % i * 50
                        acked[s.append_turn(ctx, payload).turn_id] = payload
                assert info.value.errno != 0
                with pytest.raises(StoreFailed):
                    s.append_turn(ctx, b"refused")
                assert s.get_head(ctx).head_turn_id == max(acked)
                s.close()  # writes nothing but the best-effort rollback, which fails too
                _switch(dev, "linear")
            subprocess.run(["e2fsck", "-fy", mapped], capture_output=True, timeout=120)  # 1: fixed
            with _mounted(mapped, tmp_path / "mnt") as mnt:
                _check(mnt / "store", acked, ctx)
        finally:
            subprocess.run(["dmsetup", "remove", "--force", DM_NAME], check=False, timeout=60)
