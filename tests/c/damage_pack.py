#!/usr/bin/env python3
"""Writes OUT: a copy of PACK with one byte flipped inside a neuron cluster
(the middle cluster of the middle FFN layer), for tests of the checksum
checks (libnflash's `verify` option, tests/c/capi_test.c).

    python3 tests/c/damage_pack.py PACK OUT

Standard library only; reads the manifest with formats/python/nflash_pack.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "formats", "python"))
import nflash_pack as nf  # noqa: E402


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: damage_pack.py PACK OUT")
    src, out = sys.argv[1], sys.argv[2]
    m = nf.Pack(src, segment_crcs=False).manifest
    ffn = m["ffn"][len(m["ffn"]) // 2]
    cluster = ffn["clusters"][len(ffn["clusters"]) // 2]
    at = m["segments"][ffn["segment"]]["offset"] + cluster["offset"] + 1
    data = bytearray(open(src, "rb").read())
    data[at] ^= 0x01
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out)
    print(f"{out}: {src} with the byte at offset {at} (a neuron cluster of segment "
          f"{m['segments'][ffn['segment']]['name']!r}) flipped")


if __name__ == "__main__":
    main()
