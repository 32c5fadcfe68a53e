"""The converted-weights cache: built once, mapped after, and laid out in 2 MB page-cache folios."""
from __future__ import annotations

import mmap
import os
import platform
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from linnet import files, weight_cache
from linnet.errors import LinnetError
from linnet.files import map_safetensors, save_aligned_safetensors
from linnet.weight_cache import (
    HUGE_PAGE,
    cached_arrays,
    cached_path,
    drop_from_page_cache,
    settle_in_huge_pages,
)


def test_built_once_then_mapped():
    calls = []
    built = {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4), "b": np.arange(5).astype(ml_dtypes.bfloat16)}

    def build():
        calls.append(1)
        return built

    first = cached_arrays("some-source", "some-conversion", build)
    again = cached_arrays("some-source", "some-conversion", build)
    assert calls == [1]
    for name, array in built.items():
        assert first[name].dtype == again[name].dtype == array.dtype
        np.testing.assert_array_equal(again[name], array)
    assert not again["w"].flags.writeable  # mapped from the file, read-only


def test_nothing_kept_without_a_source_or_with_the_cache_off(monkeypatch):
    calls = []

    def build():
        calls.append(1)
        return {"w": np.ones(3, np.float32)}

    cached_arrays(None, "in-memory", build)
    cached_arrays(None, "in-memory", build)
    monkeypatch.setenv("LINNET_CACHE", "off")
    cached_arrays("off-source", "off-conversion", build)
    cached_arrays("off-source", "off-conversion", build)
    assert calls == [1, 1, 1, 1]


def test_a_failed_write_leaves_nothing(monkeypatch):
    def full_disk(arrays, path, metadata):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_cache, "save_aligned_safetensors",
                        lambda path, arrays, metadata: full_disk(arrays, path, metadata))
    with pytest.raises(LinnetError, match="cannot write to .*: No space left on device"):
        cached_arrays("full-source", "full-conversion", lambda: {"w": np.ones(3, np.float32)})
    path = cached_path("full-source", "full-conversion")
    assert not path.exists() and not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def _large_folios_expected(path: Path) -> str | None:
    """Why this machine would not give a file 2 MB page-cache folios, or None if it should."""
    if platform.system() != "Linux":
        return "Linux only"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        return "transparent huge pages are off"
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    fs = max((m for m in mounts if str(path.resolve()).startswith(m[1])), key=lambda m: len(m[1]))[2]
    kernel = tuple(int(x) for x in platform.release().split(".")[:2])
    if fs == "xfs" or (fs == "ext4" and kernel >= (6, 16)):
        return None
    return f"{fs} on Linux {platform.release()} keeps no large page-cache folios"


def _pmd_mapped_after_reverse_touch(path: Path) -> int:
    """Bytes of path mapped with 2 MB pages after touching every 4 KB page from the end backwards."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        for offset in range(len(view) - 1, -1, -4096):  # backwards: read-ahead cannot grow its folios
            view[offset]
        kb, in_file = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                in_file = fields[-1] == str(path.resolve())
            elif in_file and fields[0] == "FilePmdMapped:":
                kb += int(fields[1])
        return kb * 1024


def test_a_file_just_converted_maps_with_huge_pages():
    # Written tensor by tensor (a model's many), the file would stay in the page cache in the small
    # folios of its writes: 0 of these 40 MB were huge-mapped without the drop after writing.
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal(1 << 18, np.float32) for i in range(40)}
    cached_arrays("huge-source", "huge-conversion", lambda: arrays)
    path = cached_path("huge-source", "huge-conversion")
    if reason := _large_folios_expected(path):
        pytest.skip(reason)
    # Every whole 2 MB stretch of the file (the first 20 of its 20-odd) is mapped with a huge page.
    assert _pmd_mapped_after_reverse_touch(path) >= 20 * HUGE_PAGE


def test_settled_file_maps_with_huge_pages():
    cached_arrays("settle-source", "settle-conversion", lambda: {"w": np.ones(6 * HUGE_PAGE // 4, np.float32)})
    path = cached_path("settle-source", "settle-conversion")
    if reason := _large_folios_expected(path):
        pytest.skip(reason)
    drop_from_page_cache(path)  # out of the page cache: read back from disk
    settle_in_huge_pages(path)
    assert _pmd_mapped_after_reverse_touch(path) >= 5 * HUGE_PAGE


def test_settling_an_empty_file_is_harmless(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    settle_in_huge_pages(empty)


def test_cached_arrays_start_on_cache_lines_and_read_as_safetensors(tmp_path, monkeypatch):
    from safetensors import safe_open

    from linnet.weight_cache import cached_arrays

    monkeypatch.setenv("LINNET_CACHE", str(tmp_path))
    arrays = {"odd": np.arange(5, dtype=np.float16), "w": np.arange(48, dtype=np.float32).reshape(3, 16),
              "b": np.ones(32, np.float32)}
    got = cached_arrays("some-source", "a-key", lambda: arrays)
    assert {name: a.ctypes.data % 64 for name, a in got.items() if name != "odd"} == {"w": 0, "b": 0}
    (path,) = tmp_path.glob("*.safetensors")
    with safe_open(str(path), "np") as f:
        assert all((f.get_tensor(name) == a).all() for name, a in arrays.items())


def test_the_least_recently_used_entries_go_past_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path))
    monkeypatch.setenv("LINNET_CACHE_MAX_GB", str(2.5 * 2**20 / 2**30))  # room for two entries of 1 MiB
    entries = [tmp_path / "a.safetensors", tmp_path / "onnx" / "b", tmp_path / "compiled" / "c",
               tmp_path / "d.safetensors"]
    for age, entry in enumerate(entries):
        target = entry / "weights.bin" if entry.suffix != ".safetensors" else entry
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(2**20))
        os.utime(entry, (1000 + age, 1000 + age))  # a is the oldest, d the newest
    writing = tmp_path / ".e.safetensors.123-abcd.tmp"  # another process's entry, not yet in place
    writing.write_bytes(bytes(2**20))
    weight_cache.used(entries[0])  # a was just read: now the newest
    removed = weight_cache.keep_within_budget(entries[1])  # b was just written
    assert sorted(removed) == sorted([entries[2], entries[3]])
    assert entries[0].exists() and entries[1].exists() and writing.exists()
    assert weight_cache.keep_within_budget(entries[1]) == []  # within the budget now


def test_arrays_made_one_at_a_time_are_written_one_at_a_time(tmp_path, monkeypatch):
    """A build of (name, array) pairs is written as it comes: each array is let go before the next is
    made (a conversion holds one converted array, not the model twice), and the file is the same."""
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path))
    arrays = {"odd": np.arange(5, dtype=np.float16), "w": np.arange(48, dtype=np.float32).reshape(3, 16),
              "b": np.ones(32, np.float32)}
    alive_when_next_made = []

    def build():
        previous = None
        for name, array in arrays.items():
            alive_when_next_made.append(previous is not None and previous() is not None)
            made = array.copy()
            previous = weakref.ref(made)
            yield name, made
            del made

    got = cached_arrays("streamed-source", "a-key", build)
    assert alive_when_next_made == [False, False, False]
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
    assert {name: a.ctypes.data % 64 for name, a in got.items() if name != "odd"} == {"w": 0, "b": 0}
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [cached_path("streamed-source", "a-key").name]


def _bytes_written() -> int:
    """Bytes this process has passed to write calls so far (Linux's /proc/self/io)."""
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("wchar:")))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts writes through Linux's /proc/self/io")
def test_a_conversion_writes_its_bytes_once(tmp_path):
    """The data goes straight to its place in the file (past room kept for the header), not through a side
    file copied after: 32 MiB of arrays cost the file's size in writes, not twice it."""
    arrays = [(f"w{i}", np.full(1 << 20, i, np.float32)) for i in range(8)] + [("odd", np.arange(5, dtype=np.float16))]
    path = tmp_path / "w.safetensors"
    before = _bytes_written()
    save_aligned_safetensors(path, iter(arrays), {"format": "pt"})
    written = _bytes_written() - before
    assert path.stat().st_size <= written < path.stat().st_size + 4096
    assert not [p for p in tmp_path.iterdir() if p != path]  # no side file left behind
    got = map_safetensors(path)
    for name, array in arrays:
        np.testing.assert_array_equal(got[name], array)


def test_a_header_past_its_room_is_put_before_the_data(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setattr(files, "HEADER_ROOM", 1024 - 8)  # room for a few entries, not 100
    arrays = {f"a-rather-long-tensor-name-{i:03d}": np.full(16, i, np.float32) for i in range(100)}
    arrays["odd"] = np.arange(3, dtype=np.float16)
    path = tmp_path / "w.safetensors"
    save_aligned_safetensors(path, iter(arrays.items()), {"format": "pt"})
    got = map_safetensors(path)
    assert {n: a.ctypes.data % 64 for n, a in got.items() if n != "odd"} == {n: 0 for n in arrays if n != "odd"}
    with safe_open(str(path), "np") as f:
        assert all((f.get_tensor(name) == a).all() for name, a in arrays.items())
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
