"""LocalStore specifics: on-disk layout, corruption detection, atomicity, races, ordering."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dart.protocol.errors import ArtifactNotFoundError, IntegrityError, StoreError
from dart.runtime.store import LocalStore, get_by_uri, local, open_store, resolve_uri

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "root", fsync=False)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _corrupt(path: Path, offset: int = 3) -> None:
    """Flip one byte in place, as bit rot or a stray writer would (same size, new mtime)."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_layout_is_the_file_at_its_key_plus_a_hidden_sidecar(store: LocalStore) -> None:
    data = b"safetensors bytes"
    store.put("weights/v3/model.safetensors", data, metadata={"policy-version": "3"}, content_type="application/x-st")
    assert (store.root / "weights/v3/model.safetensors").read_bytes() == data
    assert _files(store.root) == ["weights/v3/.dart-meta/model.safetensors.json", "weights/v3/model.safetensors"]
    sidecar = json.loads((store.root / "weights/v3/.dart-meta/model.safetensors.json").read_text())
    assert sidecar["sha256"] == hashlib.sha256(data).hexdigest()
    assert sidecar["content_type"] == "application/x-st"
    assert sidecar["metadata"] == {"policy-version": "3"}
    assert sidecar["size"] == len(data)
    assert store.path("weights/v3/model.safetensors") == store.root / "weights/v3/model.safetensors"
    assert store.uri("weights/v3/model.safetensors") == f"file://{store.root}/weights/v3/model.safetensors"


def test_corruption_is_detected_by_get(store: LocalStore) -> None:
    data = bytes(range(256)) * 40
    info = store.put("a/blob", data)
    _corrupt(store.path("a/blob"))
    with pytest.raises(IntegrityError) as exc:
        store.get("a/blob")
    assert exc.value.uri == info.uri
    assert exc.value.expected == info.sha256
    assert exc.value.actual != info.sha256
    assert "corrupted" in str(exc.value)
    # Opting out of verification returns the bytes as they are.
    assert store.get("a/blob", verify=False) != data


def test_corruption_is_detected_after_the_last_chunk_of_get_stream(store: LocalStore) -> None:
    data = os.urandom(10_000)
    store.put("blob", data)
    _corrupt(store.path("blob"), offset=9_999)
    received = []
    with pytest.raises(IntegrityError), store.get_stream("blob", chunk_size=1000) as stream:
        for chunk in stream:
            received.append(chunk)
    # Every chunk was delivered before the verdict.
    assert len(b"".join(received)) == len(data)
    assert b"".join(store.get_stream("blob", verify=False)) != data


def test_truncation_is_detected(store: LocalStore) -> None:
    store.put("blob", b"0123456789")
    store.path("blob").write_bytes(b"01234")
    with pytest.raises(IntegrityError):
        store.get("blob")


def test_get_to_file_leaves_nothing_behind_on_corruption(store: LocalStore, tmp_path: Path) -> None:
    store.put("blob", b"x" * 5000)
    _corrupt(store.path("blob"))
    out = tmp_path / "downloads"
    out.mkdir()
    with pytest.raises(IntegrityError):
        store.get_to_file("blob", out / "blob")
    assert list(out.iterdir()) == []


def test_files_put_there_by_other_tools_are_artifacts_without_a_digest(store: LocalStore) -> None:
    (store.root / "imported").mkdir()
    (store.root / "imported/data.bin").write_bytes(b"external")
    info = store.stat("imported/data.bin")
    assert (info.size, info.sha256, info.content_type, info.metadata) == (8, None, None, {})
    assert store.get("imported/data.bin") == b"external"
    assert [i.key for i in store.list()] == ["imported/data.bin"]


def test_a_failed_write_leaves_no_temporary_files(store: LocalStore) -> None:
    store.put("k", b"old")

    def broken() -> Iterator[bytes]:
        yield b"new"
        raise OSError("disk went away")

    with pytest.raises(StoreError, match="disk went away"):
        store.put_stream("k", broken())
    with pytest.raises(IntegrityError):
        store.put("k", b"new", sha256=hashlib.sha256(b"other").hexdigest())
    assert store.get("k") == b"old"
    assert _files(store.root) == [".dart-meta/k.json", "k"]


def test_concurrent_overwrites_never_show_a_torn_or_mismatched_artifact(store: LocalStore) -> None:
    versions = [b"A" * 1000, b"B" * 3000]
    store.put("hot", versions[0])
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(300):
                store.put("hot", versions[i % 2])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            stop.set()

    def reader(streaming: bool) -> None:
        try:
            while not stop.is_set():
                data = b"".join(store.get_stream("hot")) if streaming else store.get("hot")
                assert data in versions
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(streaming,)) for streaming in (False, True, False)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []


def test_a_reader_kept_off_the_cpu_while_overwrites_went_on_still_reads_a_whole_artifact(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader read the sidecar, then (on a busy machine) ran again only after two overwrites and past
    every wait the store allows a writer between its renames: it finds the sidecar moved on, and reads again."""
    versions = [b"A" * 1000, b"B" * 3000, b"C" * 2000]
    store.put("hot", versions[0])
    stale = local._read_sidecar(store.path("hot"))
    for data in versions[1:]:
        store.put("hot", data)
    calls = []

    def first_read_is_stale(path: Path) -> tuple[dict[str, object], int | None]:
        calls.append(path)
        return stale if len(calls) == 1 else real_read(path)

    real_read = local._read_sidecar
    monkeypatch.setattr(local, "_RACE_WAIT_S", 0.0)
    monkeypatch.setattr(local, "_read_sidecar", first_read_is_stale)
    assert store.get("hot") == versions[2]
    assert len(calls) >= 3  # the stale read, the look that saw the sidecar move on, the read that matched


def test_the_old_artifact_stays_whole_when_a_writer_stops_between_its_two_renames(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = b"old" * 100, b"new" * 200
    store.put("k", old)
    real_replace = os.replace

    def sidecar_only(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst) == store.path("k"):
            raise OSError("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", sidecar_only)
    with pytest.raises(StoreError, match="killed between the renames"):
        store.put("k", new)
    monkeypatch.undo()
    # The new sidecar is in place, the old file with it: the old file's record is still found.
    assert json.loads((store.root / ".dart-meta/k.json").read_text())["size"] == len(new)
    assert store.get("k") == old
    assert b"".join(store.get_stream("k")) == old
    assert store.stat("k").sha256 == hashlib.sha256(old).hexdigest()
    store.put("k", new)
    assert store.get("k") == new
    sidecar = json.loads((store.root / ".dart-meta/k.json").read_text())
    assert "previous" not in sidecar["previous"]  # one level kept, not a growing chain


def test_list_is_in_key_order(store: LocalStore) -> None:
    # '.' (0x2e) sorts before '/' (0x2f): "a.txt" comes before "a/b", as S3 lists them.
    keys = ["a/b", "a.txt", "a-z", "a/c/d", "b", "A"]
    for key in keys:
        store.put(key, b"x")
    assert [i.key for i in store.list()] == sorted(keys)
    assert [i.key for i in store.list("a")] == sorted(k for k in keys if k.startswith("a"))


def test_list_skips_bookkeeping_and_names_that_are_not_keys(store: LocalStore) -> None:
    store.put("ok", b"x")
    (store.root / "bad\\name").write_bytes(b"x")
    (store.root / ".dart-tmp-leftover").write_bytes(b"x")
    assert [i.key for i in store.list()] == ["ok"]
    info = next(store.list())
    assert info.sha256 == hashlib.sha256(b"x").hexdigest()


def test_delete_prunes_emptied_directories_but_not_the_root(store: LocalStore) -> None:
    store.put("a/b/c/d", b"x")
    store.put("a/keep", b"y")
    store.delete("a/b/c/d")
    assert _files(store.root) == ["a/.dart-meta/keep.json", "a/keep"]
    assert not (store.root / "a/b").exists()
    store.delete("a/keep")
    assert list(store.root.iterdir()) == []
    assert store.root.is_dir()


def test_a_key_cannot_be_both_a_file_and_a_directory(store: LocalStore) -> None:
    store.put("a", b"file")
    with pytest.raises(StoreError, match="existing artifact"):
        store.put("a/b", b"x")
    store.put("d/e", b"x")
    with pytest.raises(StoreError, match="keys under 'd/' exist"):
        store.put("d", b"x")
    with pytest.raises(ArtifactNotFoundError):
        store.get("d")
    assert not store.exists("d")
    store.delete("d")  # a directory of other keys is not an artifact: nothing to delete
    assert store.get("d/e") == b"x"


def test_fsync_mode_writes_the_same_artifacts(tmp_path: Path) -> None:
    durable = LocalStore(tmp_path / "durable", fsync=True)
    info = durable.put("a/b", b"durable bytes")
    assert durable.get("a/b") == b"durable bytes" and info.size == 13


def test_root_must_be_a_usable_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreError, match="cannot use"):
        LocalStore(tmp_path / "file")
    assert not LocalStore(tmp_path / "absent", create=False).exists("k")
    assert not (tmp_path / "absent").exists()


def test_file_uris_resolve_whatever_the_root(store: LocalStore, tmp_path: Path) -> None:
    info = store.put("runs/7/weights.bin", b"w")
    # The URI does not say where the root was; the sidecar beside the file still verifies it.
    resolved, key = resolve_uri(info.uri)
    assert key == "weights.bin" and isinstance(resolved, LocalStore)
    assert resolved.stat(key).sha256 == info.sha256
    _corrupt(store.path("runs/7/weights.bin"), offset=0)
    with pytest.raises(IntegrityError):
        get_by_uri(info.uri)
    with pytest.raises(ArtifactNotFoundError):
        get_by_uri(f"file://{tmp_path}/nowhere/x.bin")
    assert not (tmp_path / "nowhere").exists()


def test_open_store_with_a_file_uri(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/store")
    assert isinstance(store, LocalStore) and store.root == tmp_path / "store" and store.fsync
    store.put("k", b"v")
    assert (tmp_path / "store/k").read_bytes() == b"v"
