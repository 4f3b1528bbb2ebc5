"""The least a Python program does to merge a checkpoint into bf16: a floor for the small case.

Start the interpreter, import numpy, map every rank file, round each 4-byte word to bf16
(nearest even; NaNs not special-cased), write the halves to one file and fsync it. No torch,
no pickle, no checks, no safetensors header: every real merge does more than this.

    python bench/cast_floor.py OUT RANK_FILE...
"""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np

CHUNK_WORDS = 1 << 18  # 1 MiB of fp32 per step: stays in cache


def cast_to(out_path: str, inputs: list[str]) -> int:
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    rounded = np.empty(CHUNK_WORDS, np.uint32)
    halves = np.empty(CHUNK_WORDS, np.uint16)
    written = 0
    try:
        for path in inputs:
            fd = os.open(path, os.O_RDONLY)
            try:
                words = os.fstat(fd).st_size // 4
                if not words:
                    continue
                with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
                    source = np.frombuffer(mapped, np.uint32, words)
                    for lo in range(0, words, CHUNK_WORDS):
                        x = source[lo : lo + CHUNK_WORDS]
                        r, h = rounded[: x.size], halves[: x.size]
                        np.right_shift(x, 16, out=r)
                        np.bitwise_and(r, 1, out=r)
                        np.add(r, 0x7FFF, out=r)
                        np.add(r, x, out=r)
                        np.right_shift(r, 16, out=r)
                        h[...] = r
                        written += os.write(out, h)
                    del source, x
            finally:
                os.close(fd)
        os.fsync(out)
    finally:
        os.close(out)
    return written


if __name__ == "__main__":
    cast_to(sys.argv[1], sys.argv[2:])
