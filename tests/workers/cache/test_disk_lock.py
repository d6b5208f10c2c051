"""The disk tier's hold on its directory (``workers.cache.disk_lock.lock_directory``): one
holder at a time, the holder's pid named to the next, released on close."""
from __future__ import annotations

import os

import pytest

from workers.cache.disk_lock import LOCK_NAME, DiskDirError, lock_directory


class TestLock:
    def test_the_holder_writes_its_pid_and_a_second_is_refused_naming_it(self, tmp_path):
        directory = tmp_path / "disk" / "w0"
        fd = lock_directory(directory)
        try:
            assert (directory / LOCK_NAME).read_text() == str(os.getpid())
            with pytest.raises(DiskDirError) as refused:
                lock_directory(directory)
            assert str(refused.value) == (f"{directory} is in use by another worker (pid "
                                          f"{os.getpid()}): give each worker its own "
                                          "[cache] disk_dir")
            assert sorted(p.name for p in directory.iterdir()) == [LOCK_NAME]   # no probe left
        finally:
            os.close(fd)

    def test_closing_releases_it_for_the_next_worker(self, tmp_path):
        os.close(lock_directory(tmp_path))
        fd = lock_directory(tmp_path)
        os.close(fd)

    def test_a_directory_that_cannot_be_made_says_what_to_set(self, tmp_path):
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        with pytest.raises(DiskDirError) as refused:
            lock_directory(blocker / "disk")
        assert str(refused.value) == (f"cannot use {blocker / 'disk'} for the disk tier: Not a "
                                      "directory; set [cache] disk_dir to a directory this "
                                      "worker can write, or disk_bytes = 0")
