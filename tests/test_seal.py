"""The Sealer hashes an artifact's files while they are written; what it hands back must equal hashing at the end."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from quantkit import seal

pytestmark = pytest.mark.unit


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def quick(root: Path) -> seal.Sealer:
    s = seal.Sealer(root, lambda p: p.name != "quantkit.json")
    s.quiet_s, s.poll_s = 0.05, 0.01
    return s.start()


def wait_sealed(s: seal.Sealer, p: Path, timeout: float = 10.0) -> None:
    """Until a hashing thread has sealed ``p`` as it stands."""
    end = time.monotonic() + timeout
    while not (p in s._jobs and s._jobs[p][1].done() and s._jobs[p][1].result() is not None):
        assert time.monotonic() < end, f"{p.name} was never sealed early"
        time.sleep(0.01)


def test_a_finished_file_is_sealed_early_and_kept(tmp_path: Path) -> None:
    s = quick(tmp_path)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"a" * 100_000)
    wait_sealed(s, shard)
    (tmp_path / "config.json").write_text("{}")  # written last: hashed by finish
    (tmp_path / "quantkit.json").write_text("{}")  # never counted
    digests = s.finish()
    assert digests == {tmp_path / "config.json": sha(b"{}"), shard: sha(b"a" * 100_000)}
    assert s.early >= 1


def test_a_file_rewritten_after_its_early_hash_is_hashed_again(tmp_path: Path) -> None:
    s = quick(tmp_path)
    f = tmp_path / "config.json"
    f.write_bytes(b'{"a": 1}')
    wait_sealed(s, f)
    s.stop()  # so that the rewrite below is seen only by finish, not re-sealed by the thread
    time.sleep(0.02)
    f.write_bytes(b'{"a": 2}')  # same size, new contents: only the signature tells
    assert s.finish() == {f: sha(b'{"a": 2}')}
    assert s.early == 0


def test_a_library_temporary_renamed_into_place(tmp_path: Path) -> None:
    """safetensors 0.8 writes ``.tmpXXXX`` beside the target and renames it when complete."""
    s = quick(tmp_path)
    tmp = tmp_path / ".tmpab12cd"
    with open(tmp, "wb") as f:
        for _ in range(20):
            f.write(os.urandom(4096))
            f.flush()
            time.sleep(0.01)  # longer than quiet_s in total: a temporary is never sealed, however quiet
    data = tmp.read_bytes()
    assert tmp not in s._jobs
    tmp.rename(tmp_path / "model.safetensors")
    assert s.finish() == {tmp_path / "model.safetensors": sha(data)}


def test_a_file_still_growing_is_not_sealed_before_it_is_done(tmp_path: Path) -> None:
    s = quick(tmp_path)
    f = tmp_path / "model.safetensors"
    with open(f, "wb") as out:
        out.write(b"x" * 1000)
        out.flush()
        wait_sealed(s, f)  # quiet for quiet_s: sealed as it stood
        out.write(b"y" * 1000)  # and then the writer went on
    assert s.finish() == {f: sha(b"x" * 1000 + b"y" * 1000)}


def test_shards_are_hashed_side_by_side_and_a_torn_hash_is_redone(tmp_path: Path) -> None:
    """Finished shards are sealed in parallel while the next is written; a hash whose file changed under it (its
    job returns None) is never kept: finish hashes that file again."""
    from concurrent.futures import Future

    s = quick(tmp_path)
    shards = [tmp_path / f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for i, p in enumerate(shards):
        p.write_bytes(bytes([i]) * 200_000)
    for p in shards:
        wait_sealed(s, p)
    s.stop()
    torn: Future = Future()
    torn.set_result(None)
    s._jobs[shards[0]] = (s._jobs[shards[0]][0], torn)
    assert seal._seal_one(shards[1], (0, 0, 0)) is None  # hashed, but not the file it was asked about
    assert s.finish() == {p: sha(bytes([i]) * 200_000) for i, p in enumerate(shards)}
    assert s.early == 2


def test_hash_and_sync_gives_the_files_sha256_and_says_an_unreadable_one(tmp_path: Path) -> None:
    """The fsync runs beside the hash in a thread of its own: the digest must still be the file's, and a failure of
    either side must reach the caller rather than die in the thread."""
    data = os.urandom(3 * (1 << 22) + 5)  # more than one read chunk, not a multiple of it
    f = tmp_path / "model-00001-of-00001.safetensors"
    f.write_bytes(data)
    assert seal.hash_and_sync(f) == hashlib.sha256(data).hexdigest()
    with pytest.raises(FileNotFoundError):
        seal.hash_and_sync(tmp_path / "gone.safetensors")


@pytest.mark.skipif(not Path("/dev/null").exists() or os.uname().sysname != "Linux",
                    reason="Linux refuses fsync on a character device (EINVAL)")
def test_a_failed_fsync_reaches_the_caller_though_the_hash_succeeded() -> None:
    """/dev/null reads (an empty file's sha256) but cannot be fsynced: a digest returned would say the file is on
    disk when it is not. The fsync's error, raised in its own thread, must be the caller's."""
    with pytest.raises(OSError):
        seal.hash_and_sync(Path("/dev/null"))


class Interrupted(Exception):
    """What SIGALRM raises in the main thread here: an interrupt while the hash reads (Ctrl-C's place)."""


@pytest.mark.skipif(not Path("/dev/zero").exists() or os.uname().sysname != "Linux",
                    reason="Linux refuses fsync on a character device (EINVAL)")
def test_an_interrupt_during_the_hash_is_not_replaced_by_the_fsyncs_error() -> None:
    """/dev/zero is hashed forever and cannot be fsynced: the interrupt that stops the hash is what reaches the
    caller, not the fsync's OSError (which _seal_one would take for a file changed meanwhile and hash again)."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            seal.hash_and_sync(Path("/dev/zero"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
