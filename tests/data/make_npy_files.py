#!/usr/bin/env python3
"""Writes the small .npy files the tests use, byte by byte (no numpy needed):

  tests/data/npy_rank5/q.npy        shape (1, 1, 1, 2, 64): refused, rank 5
  tests/data/npy_trailing/q.npy     shape (1, 1, 2, 64) and 2 bytes more than it needs: refused
  tests/data/npy_nan_in_k/*.npy     q, k, v of shape (1, 1, 2, 64); k holds a NaN at [0, 0, 1, 3]
  tests/fuzz/corpus/*               seeds for the .npy fuzzer, valid and broken

Run it from anywhere; it rewrites those files and nothing else.
"""
import os
import struct

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAGIC = b"\x93NUMPY"
UNPADDED = b"{'descr':'<f2','fortran_order':False,'shape':(1,1,1,1)}"  # no padding, no newline


def header(text, version=1):
    """Magic, version, header length and the header, padded with spaces and ended with a newline
    so that the data start on a 64-byte boundary, as numpy writes it."""
    preamble = 10 if version == 1 else 12
    body = text.encode("latin1")
    padded = (preamble + len(body) + 1 + 63) // 64 * 64
    body += b" " * (padded - preamble - len(body) - 1) + b"\n"
    size = struct.pack("<H", len(body)) if version == 1 else struct.pack("<I", len(body))
    return MAGIC + bytes([version, 0]) + size + body


def dict_text(shape, descr="<f2", fortran="False"):
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    return "{'descr': '%s', 'fortran_order': %s, 'shape': (%s), }" % (descr, fortran, dims)


def values(count, nan_at=None):
    """count fp16 values, little-endian: small distinct numbers, and a NaN at index nan_at."""
    out = [struct.pack("<e", ((i * 37) % 101 - 50) / 16.0) for i in range(count)]
    if nan_at is not None:
        out[nan_at] = struct.pack("<H", 0x7E00)
    return b"".join(out)


def array(shape, **kw):
    count = 1
    for d in shape:
        count *= d
    return header(dict_text(shape, **kw)) + values(count)


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def main():
    data = os.path.join(TESTS, "data")
    write(os.path.join(data, "npy_rank5", "q.npy"), array((1, 1, 1, 2, 64)))
    write(os.path.join(data, "npy_trailing", "q.npy"), array((1, 1, 2, 64)) + b"\x00\x3c")
    for name in ("q", "k", "v"):
        body = values(128, nan_at=1 * 64 + 3 if name == "k" else None)
        write(os.path.join(data, "npy_nan_in_k", name + ".npy"), header(dict_text((1, 1, 2, 64))) + body)

    seeds = {
        # Valid: the harness's own layout, other shapes, versions 2.0 and 3.0, other spellings.
        "valid_1x1x2x64": array((1, 1, 2, 64)),
        "valid_2x3x5x7": array((2, 3, 5, 7)),
        "valid_1x1x1x1": array((1, 1, 1, 1)),
        "valid_v2": header(dict_text((1, 1, 1, 4)), version=2) + values(4),
        "valid_v3": header(dict_text((1, 1, 1, 4)), version=3) + values(4),
        "valid_double_quotes_reordered": header(
            '{"shape":(1,1,1,2),"fortran_order":False,"descr":"<f2"}') + values(2),
        "valid_trailing_comma_spaces": header(
            "{ 'descr' : '<f2' , 'fortran_order' : False , 'shape' : ( 1 , 1 , 1 , 2 , ) , }") + values(2),
        "valid_unpadded": MAGIC + b"\x01\x00" + struct.pack("<H", len(UNPADDED)) + UNPADDED + values(1),
        # Refused: rank, data length, dtype, order, dimensions, header syntax, preamble.
        "rank5": array((1, 1, 1, 2, 64)),
        "rank3": array((1, 2, 64)),
        "rank1": array((4,)),
        "rank0": header(dict_text(())) + values(1),
        "trailing_bytes": array((1, 1, 1, 4)) + b"\x00",
        "truncated_data": array((1, 1, 1, 4))[:-3],
        "truncated_header": array((1, 1, 1, 4))[:40],
        "bad_magic": b"\x93NUMPZ" + array((1, 1, 1, 1))[6:],
        "version_4": MAGIC + b"\x04\x00" + array((1, 1, 1, 1))[8:],
        "version_1_1": MAGIC + b"\x01\x01" + array((1, 1, 1, 1))[8:],
        "big_endian": array((1, 1, 1, 2), descr=">f2"),
        "float32": header(dict_text((1, 1, 1, 2), descr="<f4")) + values(4),
        "pipe_f2": array((1, 1, 1, 2), descr="|f2"),
        "fortran_order": array((1, 1, 2, 2), fortran="True"),
        "zero_dim": header(dict_text((1, 0, 2, 2))),
        "dim_over_int_max": header(dict_text((1, 1, 1, 2147483648))) + values(2),
        "product_overflow": header(dict_text((2147483647, 2147483647, 2147483647, 2147483647))) + values(2),
        "negative_dim": header("{'descr': '<f2', 'fortran_order': False, 'shape': (1, -1, 1, 1), }") + values(1),
        "leading_zero": header("{'descr': '<f2', 'fortran_order': False, 'shape': (1, 01, 1, 1), }") + values(1),
        "unknown_key": header("{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 1, 1), 'x': 1}") + values(1),
        "duplicate_key": header("{'descr': '<f2', 'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 1, 1)}") + values(1),
        "missing_key": header("{'descr': '<f2', 'shape': (1, 1, 1, 1)}") + values(1),
        "text_after_dict": header("{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 1, 1)} x") + values(1),
        "unterminated_string": header("{'descr': '<f2, 'fortran_order': False, 'shape': (1, 1, 1, 1)}") + values(1),
        "non_ascii": header("{'descr': '<f2', 'fortran_order': Fals\xe9, 'shape': (1, 1, 1, 1)}") + values(1),
        "huge_header_len_v2": MAGIC + b"\x02\x00" + struct.pack("<I", 0xFFFFFFFF) + b"{}",
        "empty": b"",
        "nine_bytes": MAGIC + b"\x01\x00\x10",
    }
    corpus = os.path.join(TESTS, "fuzz", "corpus")
    for name, blob in seeds.items():
        write(os.path.join(corpus, name), blob)


if __name__ == "__main__":
    main()
