"""The file of one K/V block (``workers.cache.disk_files``): its name, its exact layout, the
round trip of every dtype it holds, and each way a file is refused (``CorruptBlock``, or
``OutdatedBlock`` for an older version)."""
from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest
import xxhash

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from router.kv.key import BlockHash, BlockIdentity
from workers.cache.disk_files import (MAGIC, SUFFIX, VERSION, BlockRecord, CorruptBlock,
                                      OutdatedBlock, block_path, decode_block, encode_block,
                                      read_header)

BLOCK = BlockHash(0x0123456789ABCDEF_FEDCBA9876543210)
PARENT = BlockHash(7)
RECORD = BlockRecord(BLOCK, BlockIdentity("tenant-a", PARENT, 3, (5, 6, 7, 8)), "tiny", "r9", 8)


def arrays(dtype: mx.Dtype = mx.float32) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
    """Two layers of keys and values, ``[1, 2 heads, 4 tokens, 3 dims]``, every value distinct."""
    base = mx.arange(24).reshape(1, 2, 4, 3)
    keys = tuple((base + 100 * layer).astype(dtype) for layer in range(2))
    values = tuple((-base - 100 * layer).astype(dtype) for layer in range(2))
    mx.eval(keys, values)
    return keys, values


def written(directory: Path, data: bytes) -> Path:
    path = block_path(directory, BLOCK)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


class TestTheFileName:
    def test_a_block_lives_under_the_first_two_hex_digits_of_its_32_digit_hash(self, tmp_path):
        assert block_path(tmp_path, BLOCK) == (
            tmp_path / "01" / "0123456789abcdeffedcba9876543210.kv")
        assert block_path(tmp_path, BlockHash(10)) == (
            tmp_path / "00" / ("0" * 31 + "a" + SUFFIX))


class TestTheLayout:
    def test_magic_version_header_payload_and_a_digest_of_everything_before_it(self):
        keys, values = arrays()
        data = encode_block(RECORD, keys, values)
        magic, version, header_len = struct.unpack_from("<4sHI", data)
        assert (magic, version) == (b"ORKV", 2) == (MAGIC, VERSION)
        header = msgpack.unpackb(data[10:10 + header_len], raw=False)
        assert header == [BLOCK.to_bytes(16, "little"), (7).to_bytes(16, "little"), "tenant-a",
                          3, "tiny", "r9", [5, 6, 7, 8], 8, 2,
                          [["float32", [1, 2, 4, 3]]] * 4]
        payload = data[10 + header_len:-16]
        assert payload == b"".join(np.array(a).tobytes() for a in (*keys, *values))
        assert len(payload) == 4 * 24 * 4
        assert data[-16:] == xxhash.xxh3_128_digest(data[:-16])


class TestTheRoundTrip:
    @pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
    def test_every_array_comes_back_with_its_dtype_shape_and_values(self, tmp_path, dtype):
        keys, values = arrays(dtype)
        data = encode_block(RECORD, keys, values)
        back = decode_block(data, written(tmp_path, data))
        assert back.record == RECORD
        assert (back.record.parent, back.record.namespace, back.record.tokens) == (
            PARENT, "tenant-a", (5, 6, 7, 8))
        assert len(back.keys) == len(back.values) == 2
        for got, want in zip((*back.keys, *back.values), (*keys, *values)):
            assert (got.dtype, got.shape) == (dtype, want.shape)
            assert mx.array_equal(got, want).item()

    def test_read_header_gives_the_record_without_the_arrays(self, tmp_path):
        keys, values = arrays()
        assert read_header(written(tmp_path, encode_block(RECORD, keys, values))) == RECORD

    def test_an_array_of_a_dtype_the_format_does_not_hold_is_refused_by_name(self):
        keys, values = arrays(mx.int32)
        with pytest.raises(ValueError, match=r"^cannot write a int32 array to a block file$"):
            encode_block(RECORD, keys, values)


class TestRefusedFiles:
    def test_a_file_one_byte_short_fails_read_header_with_both_sizes(self, tmp_path):
        keys, values = arrays()
        data = encode_block(RECORD, keys, values)
        path = written(tmp_path, data[:-1])
        with pytest.raises(CorruptBlock, match=rf"{len(data) - 1} bytes, its header says "
                                               rf"{len(data)} \(truncated write\)"):
            read_header(path)

    def test_a_flipped_payload_byte_fails_the_checksum(self, tmp_path):
        keys, values = arrays()
        data = bytearray(encode_block(RECORD, keys, values))
        data[-20] ^= 1
        path = written(tmp_path, bytes(data))
        assert read_header(path) == RECORD  # the header alone cannot tell
        with pytest.raises(CorruptBlock, match=r"checksum mismatch \(torn or corrupted file\)"):
            decode_block(bytes(data), path)

    def test_a_file_shorter_than_a_prefix_and_a_digest_is_too_short(self, tmp_path):
        with pytest.raises(CorruptBlock, match=r"25 bytes is too short for a block file"):
            decode_block(b"x" * 25, tmp_path / "b.kv")

    def test_a_file_without_the_magic_is_not_a_block_file(self, tmp_path):
        keys, values = arrays()
        data = b"NOPE" + encode_block(RECORD, keys, values)[4:]
        path = written(tmp_path, data)
        with pytest.raises(CorruptBlock, match=r"not an orchard block file"):
            read_header(path)

    @pytest.mark.parametrize("version, error", [(1, OutdatedBlock), (3, CorruptBlock)])
    def test_an_older_version_is_outdated_and_a_newer_one_corrupt(self, tmp_path, version,
                                                                   error):
        keys, values = arrays()
        data = bytearray(encode_block(RECORD, keys, values))
        struct.pack_into("<H", data, 4, version)
        path = written(tmp_path, bytes(data))
        with pytest.raises(CorruptBlock, match=rf"block file version {version}, this orchard "
                                               rf"reads 2") as raised:
            read_header(path)
        assert type(raised.value) is error

    def test_a_header_that_is_not_the_format_is_unreadable(self, tmp_path):
        header = msgpack.packb(["too", "few", "fields"])
        path = written(tmp_path, struct.pack("<4sHI", MAGIC, VERSION, len(header)) + header)
        with pytest.raises(CorruptBlock, match=r"unreadable header"):
            read_header(path)

    def test_an_unknown_array_dtype_in_the_header_is_refused(self, tmp_path):
        header = msgpack.packb([BLOCK.to_bytes(16, "little"), PARENT.to_bytes(16, "little"),
                                "ns", 0, "m", "r", [1], 0, 1, [["complex64", [1]]]],
                               use_bin_type=True)
        path = written(tmp_path, struct.pack("<4sHI", MAGIC, VERSION, len(header)) + header)
        with pytest.raises(CorruptBlock, match=r"unknown array dtype in \[\('complex64', \(1,\)\)\]"):
            read_header(path)

    def test_bytes_after_the_payload_are_refused_even_under_a_good_digest(self, tmp_path):
        keys, values = arrays()
        body = encode_block(RECORD, keys, values)[:-16] + b"\0\0\0\0"
        data = body + xxhash.xxh3_128_digest(body)
        with pytest.raises(CorruptBlock, match=r"4 unexpected bytes after the payload"):
            decode_block(data, written(tmp_path, data))

    def test_a_payload_shorter_than_its_header_says_is_refused(self, tmp_path):
        keys, values = arrays()
        body = encode_block(RECORD, keys, values)[:-16 - 4]
        data = body + xxhash.xxh3_128_digest(body)
        with pytest.raises(CorruptBlock, match=r"payload shorter than its header says"):
            decode_block(data, written(tmp_path, data))
