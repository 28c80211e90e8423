"""What identifying a local checkpoint exactly costs at start (`weights_identity.py`).

Times:
  hash rates   GiB/s of each candidate over a buffer in memory, on 1 thread and on
               every core (hashlib releases the GIL); xxh3_128 where `xxhash` imports
  read+hash    GiB/s of `file_digest`'s read loop over one file, by chunk size, the
               file in the page cache
  start        a checkpoint of `--gib` GiB (in 1 and in 2 files): first start with
               the file in the page cache, first start with it evicted (read from
               disk), a later start (the digest kept), and a hub snapshot (blob names)
Prints a table and writes benchmarks/results/weights_digest.json.

Each figure is the best of `--runs` (the machine may be shared).

Usage: .venv/bin/python benchmarks/weights_digest.py [--gib 1] [--dir /tmp] [--runs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_cpu_offload import file_digest  # noqa: E402
from vllm_cpu_offload.weights_identity import checkpoint_digest  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GIB = 1 << 30
LONG_AGO = 1_000_000_000
# One line of the table: `measure` and `GiB/s` or `s`.
Row = dict[str, Any]


def hashers() -> dict[str, Callable[[], object]]:
    found: dict[str, Callable[[], object]] = {
        "sha256": hashlib.sha256,
        "sha1": hashlib.sha1,
        "blake2b": hashlib.blake2b,
    }
    try:
        import xxhash

        found["xxh3_128"] = xxhash.xxh3_128
    except ImportError:
        pass
    return found


def best_of(
    runs: int, best: Callable[..., float], measure: Callable[..., float], *args: object
) -> float:
    """The best of `runs` calls of `measure(*args)`: the machine's figure, not its
    other tenants' (2 shared cores)."""
    return best(measure(*args) for _ in range(runs))


def hash_rate(make: Callable[[], object], threads: int, buffer: bytes) -> float:
    """GiB/s of `threads` threads each hashing `buffer` 4 times."""

    def work() -> None:
        h = make()
        for _ in range(4):
            h.update(buffer)  # type: ignore[attr-defined]

    pool = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return threads * 4 * len(buffer) / GIB / (time.perf_counter() - start)


def read_rate(path: Path, chunk: int) -> float:
    file_digest._CHUNK_BYTES = chunk
    version = file_digest.FileVersion.of(path)
    start = time.perf_counter()
    file_digest._read_and_hash(path, version)
    return path.stat().st_size / GIB / (time.perf_counter() - start)


def write_checkpoint(folder: Path, total: int, files: int) -> list[Path]:
    folder.mkdir(parents=True)
    written = []
    block = os.urandom(64 << 20)
    for i in range(files):
        f = folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(f, "wb") as fh:
            for _ in range(total // files // len(block)):
                fh.write(block)
        os.utime(f, (LONG_AGO, LONG_AGO))
        written.append(f)
    return written


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def start_cost(folder: Path, files: list[Path], cold: bool, from_disk: bool) -> float:
    """Seconds `checkpoint_digest` takes at a new process's start."""
    file_digest.forget_in_process()
    if cold:
        for entry in file_digest.digest_cache_dir().glob("*.json"):
            entry.unlink()
    if from_disk:
        evict(files)
    start = time.perf_counter()
    checkpoint_digest(folder)
    return time.perf_counter() - start


def machine() -> dict[str, str]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (ln.partition(":") for ln in lscpu.split("\n"))
    )
    flags = fields.get("Flags", "").split()
    return {
        "cpu": fields.get("Model name", platform.processor()),
        "cores": str(len(os.sched_getaffinity(0))),
        "sha_ni": str("sha_ni" in flags),
        "openssl": __import__("ssl").OPENSSL_VERSION,
        "python": platform.python_version(),
    }


def hash_rows(runs: int, cores: int) -> list[Row]:
    rows: list[Row] = []
    buffer = os.urandom(256 << 20)
    for name, make in hashers().items():
        for threads in sorted({1, cores}):
            rate = best_of(runs, max, hash_rate, make, threads, buffer)
            rows.append({"measure": f"hash {name}, {threads} thread(s)", "GiB/s": rate})
    return rows


def chunk_rows(runs: int, path: Path) -> list[Row]:
    chosen = file_digest._CHUNK_BYTES
    rows: list[Row] = []
    for chunk in (256 << 10, 1 << 20, 8 << 20, 32 << 20):
        rate = best_of(runs, max, read_rate, path, chunk)
        rows.append(
            {"measure": f"read+sha256, {chunk >> 10} KiB chunks", "GiB/s": rate}
        )
    file_digest._CHUNK_BYTES = chosen
    return rows


def start_rows(runs: int, tmp: Path, gib: float, count: int) -> list[Row]:
    folder = tmp / f"ckpt{count}"
    files = write_checkpoint(folder, int(gib * GIB), count)
    rows = chunk_rows(runs, files[0]) if count == 1 else []
    label = f"{gib:g} GiB in {count} file(s)"
    for what, cold, disk in (
        ("first start, page cache", True, False),
        ("first start, from disk", True, True),
        ("later start (digest kept)", False, False),
    ):
        took = best_of(runs, min, start_cost, folder, files, cold, disk)
        rows.append({"measure": f"{label}: {what}", "s": took})
    for f in files:
        f.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--runs", type=int, default=3, help="best of this many")
    args = parser.parse_args()
    meta = machine()
    rows = hash_rows(args.runs, int(meta["cores"]))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        os.environ["VLLM_CPU_OFFLOAD_CACHE"] = str(Path(tmp, "cache"))
        for count in (1, 2):
            rows += start_rows(args.runs, Path(tmp), args.gib, count)
    print(" | ".join(f"{k} {v}" for k, v in meta.items()))
    for row in rows:
        value = (
            f"{row['GiB/s']:8.2f} GiB/s"
            if "GiB/s" in row
            else f"{row['s'] * 1e3:10.3f} ms"
        )
        print(f"{row['measure']:<50} {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "weights_digest.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
