"""GB/s of block-scattered KV copies between the device caches and the host buffer.

For each cache shape, copies a batch of randomly scattered blocks (every layer) with:
  ours       TransferEngine.copy_blocks: Triton kernels on CUDA, stacked torch views on CPU
  loop       a per-block, per-layer torch copy loop (the naive way)
  memcpy     one plain copy of the same bytes between two contiguous tensors (the limit;
             on CUDA pinned host <-> device, i.e. the DMA engine at PCIe speed)
in both directions (store = device->host, load = host->device) and, on CUDA, both at once
on two streams. On CUDA it also measures how much a matmul slows down while copies run
beside it (on the CPU platform copies are synchronous with the forward: they add their time).
Timing: methods interleave within each repetition (the machine may be shared); GB/s is the
best repetition, `vs memcpy` the median over repetitions of (memcpy time / method time).

Usage: /work/venv/bin/python benchmarks/transfer.py [--shapes llama3-8b small]
           [--reps 7] [--threads N] [--sweep]     (--sweep: Triton constants, CUDA only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_cpu_offload.worker.host_buffer import HostBuffer  # noqa: E402
from vllm_cpu_offload.worker.transfer_engine import TransferEngine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def page_bytes(self) -> int:
        """One layer's K and V of one block."""
        return self.kv_heads * self.block_size * 2 * self.head_dim * self.dtype.itemsize


SHAPES = {
    "llama3-8b": Shape("llama3-8b", layers=32, kv_heads=8, head_dim=128),
    "small": Shape("small (llama3.2-1b)", layers=16, kv_heads=8, head_dim=64),
}


def make_caches(shape: Shape, num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    """vLLM 0.32's LBHNC layout (CPU backend, vLLM's own offloading connector):
    all layers in one buffer, per layer `[B, H, N, 2 * D]`."""
    raw = torch.empty(
        (shape.layers, num_blocks, shape.kv_heads, shape.block_size, 2 * shape.head_dim),
        dtype=shape.dtype,
        device=device,
    )
    raw.view(torch.uint8).fill_(1)  # fault the pages in before timing
    return {f"model.layers.{i}.self_attn.attn": raw[i] for i in range(shape.layers)}


class Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def bench_shape(shape: Shape, args: argparse.Namespace, device: str, pattern: str) -> list[dict]:
    caches = make_caches(shape, args.device_blocks, device)
    host = HostBuffer.for_kv_caches(caches, args.host_blocks)
    host.tensor.fill_(2)
    engine = TransferEngine(caches, host)
    n = min(args.batch, args.device_blocks, args.host_blocks)
    gen = torch.Generator().manual_seed(0)
    if pattern == "scattered":  # every block on its own: the worst case
        d_ids = torch.randperm(args.device_blocks, generator=gen)[:n]
        h_ids = torch.randperm(args.host_blocks, generator=gen)[:n]
    else:  # one request's prefix into freshly allocated host blocks
        d_ids = torch.arange(n) + (args.device_blocks - n) // 2
        h_ids = torch.arange(n)
    d_dev, h_dev = d_ids.to(device), h_ids.to(device)
    d_list, h_list = d_ids.tolist(), h_ids.tolist()
    nbytes = n * shape.layers * shape.page_bytes

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
    dst_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=host.pinned).fill_(4)
    layer_views = [(t.view(t.shape[0], -1), host.layer_view(name)) for name, t in caches.items()]

    def ours(to_host: bool) -> Callable[[], None]:
        return lambda: engine.copy_blocks(to_host, d_dev, h_dev)

    def loop(to_host: bool) -> Callable[[], None]:
        def run() -> None:
            for dev, hv in layer_views:
                for d, h in zip(d_list, h_list, strict=True):
                    dev_block = dev[d].view(torch.uint8)
                    if to_host:
                        hv[h].copy_(dev_block, non_blocking=True)
                    else:
                        dev_block.copy_(hv[h], non_blocking=True)

        return run

    def memcpy(to_host: bool) -> Callable[[], None]:
        def run() -> None:
            if to_host:
                dst_host.copy_(src, non_blocking=True)
            else:
                src.copy_(dst_host, non_blocking=True)

        return run

    methods: dict[str, tuple[Callable[[], None], int]] = {}
    for direction, to_host in (("store", True), ("load", False)):
        methods[f"{direction}/ours"] = (ours(to_host), nbytes)
        methods[f"{direction}/loop"] = (loop(to_host), nbytes)
        methods[f"{direction}/memcpy"] = (memcpy(to_host), nbytes)
    if device == "cuda":
        methods["both/ours"] = (_both(ours(True), ours(False)), 2 * nbytes)
        methods["both/memcpy"] = (_both(memcpy(True), memcpy(False)), 2 * nbytes)

    timer = Timer(device)
    times: dict[str, list[float]] = {k: [] for k in methods}
    for fn, _ in methods.values():  # warm-up: compile, fault pages
        timer(fn)
    for _ in range(args.reps):
        for key, (fn, _) in methods.items():
            times[key].append(timer(fn))

    rows = []
    for key, (_, moved) in methods.items():
        direction, method = key.split("/")
        limit = times[f"{direction}/memcpy"]
        ratio = statistics.median(m / t for m, t in zip(limit, times[key], strict=True))
        rows.append(
            {
                "shape": shape.name,
                "ids": pattern,
                "direction": direction,
                "method": method,
                "blocks": n,
                "block_bytes": shape.layers * shape.page_bytes,
                "bytes": moved,
                "best_s": min(times[key]),
                "median_s": statistics.median(times[key]),
                "gb_per_s": moved / min(times[key]) / 1e9,
                "vs_memcpy": ratio,
            }
        )
    if device == "cuda":  # on the CPU platform copies never run beside compute
        rows += matmul_slowdown(shape, methods, timer, device)
    return rows


def _both(a: Callable[[], None], b: Callable[[], None]) -> Callable[[], None]:
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def run() -> None:
        for stream, fn in zip(streams, (a, b), strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)

    return run


def matmul_slowdown(
    shape: Shape, methods: dict[str, tuple[Callable[[], None], int]], timer: Timer, device: str
) -> list[dict]:
    """Time of a matmul loop while each copy method runs beside it, over its time alone."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    iters = 50

    def matmuls() -> None:
        for _ in range(iters):
            a @ a

    alone = min(timer(matmuls) for _ in range(3))
    rows = []
    for key in ("store/ours", "store/memcpy", "load/ours", "load/memcpy"):
        copy = methods[key][0]
        with_copies = min(_beside(matmuls, copy, timer) for _ in range(3))
        rows.append(
            {
                "shape": shape.name,
                "ids": "scattered",
                "direction": key.split("/")[0],
                "method": f"matmul beside {key.split('/')[1]}",
                "slowdown": with_copies / alone,
                "matmul_alone_s": alone,
            }
        )
    return rows


def _beside(main: Callable[[], None], copy: Callable[[], None], timer: Timer) -> float:
    """Time of `main` while copies queued on a side stream run beside it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(8):  # queue enough copies to overlap the whole matmul loop
            copy()
    elapsed = timer(main)
    stream.synchronize()
    return elapsed


def sweep(args: argparse.Namespace) -> list[dict]:
    """CUDA only: GB/s of our kernel over BLOCK_WORDS x NUM_WARPS for the 8B shape."""
    from vllm_cpu_offload.worker import copy_kernels

    rows = []
    shape = SHAPES["llama3-8b"]
    caches = make_caches(shape, args.device_blocks, "cuda")
    host = HostBuffer.for_kv_caches(caches, args.host_blocks)
    n = min(args.batch, args.device_blocks, args.host_blocks)
    d = torch.randperm(args.device_blocks)[:n].cuda()
    h = torch.randperm(args.host_blocks)[:n].cuda()
    timer = Timer("cuda")
    for block_words in (256, 512, 1024, 2048, 4096):
        for warps in (1, 2, 4, 8):
            copy_kernels.BLOCK_WORDS, copy_kernels.NUM_WARPS = block_words, warps
            copier = copy_kernels.TritonBlockCopier(caches, host)
            for to_host in (True, False):
                timer(lambda: copier.copy(to_host, d, h))  # noqa: B023
                best = min(timer(lambda: copier.copy(to_host, d, h)) for _ in range(args.reps))  # noqa: B023
                gbps = n * shape.layers * shape.page_bytes / best / 1e9
                rows.append(
                    {
                        "block_words": block_words,
                        "num_warps": warps,
                        "direction": "store" if to_host else "load",
                        "gb_per_s": gbps,
                    }
                )
                print(
                    f"BLOCK_WORDS={block_words:5d} num_warps={warps} "
                    f"{rows[-1]['direction']:5s} {gbps:7.2f} GB/s"
                )
    return rows


def machine(device: str) -> dict:
    info = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def print_table(rows: list[dict]) -> None:
    print(
        f"{'shape':20s} {'ids':9s} {'dir':5s} {'method':20s} {'blocks':>6s} {'MiB':>6s} "
        f"{'GB/s':>6s} {'vs memcpy':>9s}"
    )
    for r in rows:
        head = f"{r['shape']:20s} {r['ids']:9s} {r['direction']:5s} {r['method']:20s}"
        if "slowdown" in r:
            print(f"{head} {'':>6s} {'':>6s} {'':>6s} x{r['slowdown']:.2f} time")
            continue
        print(
            f"{head} {r['blocks']:6d} {r['bytes'] / 2**20:6.0f} {r['gb_per_s']:6.2f} "
            f"{r['vs_memcpy']:9.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--device-blocks", type=int, default=512)
    parser.add_argument("--host-blocks", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128, help="blocks copied per call")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--ids",
        nargs="+",
        default=["scattered", "runs"],
        choices=["scattered", "runs"],
        help="block id patterns",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--sweep", action="store_true", help="sweep Triton constants (CUDA)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"machine": machine(device), "args": vars(args) | {"out": None}}
    if args.sweep:
        result["sweep"] = sweep(args)
    rows = []
    for name in args.shapes:
        for pattern in args.ids:
            rows += bench_shape(SHAPES[name], args, device, pattern)
    result["rows"] = rows
    print_table(rows)
    out = args.out or RESULTS / f"transfer_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
