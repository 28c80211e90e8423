"""GB/s of block-scattered KV copies between the device caches and the host buffer.

For each cache shape, copies a batch of randomly scattered blocks (every layer) with:
  ours TransferEngine.copy_blocks with its default copier (CPU: stacked torch views) dma
  CUDA: the copy engines, one cudaMemcpyBatchAsync per launch (dma.py) triton CUDA:
  the Triton kernels (copy_kernels.py) staged-* CUDA: whole blocks through device
  staging (staged_copy.py), gathered on the
             copy engines (staged-dma) or the kernels (staged-kernel)
  loop       a per-block, per-layer torch copy loop (the naive way)
  memcpy     one plain copy of the same bytes between two contiguous tensors (the limit;
             on CUDA pinned host <-> device, i.e. the DMA engine at PCIe speed)
in both directions (store = device->host, load = host->device) and, on CUDA, both at
once on two streams. On CUDA it also measures how much a matmul slows down while copies
run beside it (on the CPU platform copies are synchronous with the forward: they add
their time). Timing: methods interleave within each repetition (the machine may be
shared); GB/s is the best repetition, `vs memcpy` the median over repetitions of (memcpy
time / method time).

Layouts: `lbhnc` (all layers in one buffer, per layer [B, H, N, 2D]: the CPU backend's)
and, on CUDA, `flash` (one tensor per layer, [2, B, N, H, D]: FlashAttention's, K and V
apart). `--run-sweep` (CUDA) times DMA and Triton copies against the run length.
`--in-vllm-worker` (CPU) runs the same measurement inside a real vLLM CPU worker, under
its OpenMP binding (the worker's initial thread is pinned to one core), which is where
the connector's copies run.

Usage: python benchmarks/transfer.py [--shapes llama3-8b small] [--layouts lbhnc flash]
           [--reps 7] [--threads N] [--sweep] [--run-sweep] (sweeps: CUDA only)
           [--staged-chunks 8 16] (CUDA only) [--in-vllm-worker] (CPU only) [--host-runs
           2 4 8] host slots in runs of K (offload_block_size of K blocks)
           [--unpinned] (CUDA: an unpinned host buffer, as a tier on a disk file
           system; `memcpy` is then pageable memory <-> device)
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
from vllm_cpu_offload.worker.transfer_engine import BlockCopier, TransferEngine  # noqa: E402

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


def make_caches(
    shape: Shape, num_blocks: int, device: str, layout: str = "lbhnc"
) -> dict[str, torch.Tensor]:
    """`lbhnc`: vLLM 0.32's LBHNC layout (CPU backend, vLLM's own offloading connector),
    all layers in one buffer, per layer `[B, H, N, 2 * D]`. `flash`: FlashAttention's
    `[2, B, N, H, D]`, one allocation per layer."""
    if layout == "flash":
        caches = {}
        for i in range(shape.layers):
            t = torch.empty(
                (2, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim),
                dtype=shape.dtype,
                device=device,
            )
            t.view(torch.uint8).fill_(1)
            caches[f"model.layers.{i}.self_attn.attn"] = t
        return caches
    raw = torch.empty(
        (
            shape.layers,
            num_blocks,
            shape.kv_heads,
            shape.block_size,
            2 * shape.head_dim,
        ),
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


def copiers(
    caches: dict[str, torch.Tensor],
    host: HostBuffer,
    device: str,
    staged_chunks: list[int],
) -> dict[str, TransferEngine]:
    """The copy methods of this machine, each behind its own transfer engine."""
    if device != "cuda":
        return {"ours": TransferEngine(caches, host)}
    if not host.pinned:
        # A tier CUDA could not pin: the engine's choice (the pinned bounce buffer)
        # against torch copies straight from pageable memory (the path before it).
        from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier

        return {
            "bounce": TransferEngine(caches, host),
            "torch": TransferEngine(
                caches, host, copier=TorchBlockCopier(caches, host)
            ),
        }
    from vllm_cpu_offload.worker.copiers.dma import DmaBlockCopier
    from vllm_cpu_offload.worker.copiers.staged import GATHERS, StagedBlockCopier
    from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

    made: dict[str, BlockCopier] = {"triton": TritonBlockCopier(caches, host)}
    try:
        made["dma"] = DmaBlockCopier(caches, host)
    except RuntimeError as e:
        print(f"no DMA copies: {e}")
    for chunk in staged_chunks:
        for gather in GATHERS:
            name = f"staged-{gather}" + (f"-{chunk}" if len(staged_chunks) > 1 else "")
            try:
                made[name] = StagedBlockCopier(
                    caches, host, chunk_blocks=chunk, gather=gather
                )
            except RuntimeError as e:
                print(f"no {name} copies: {e}")
    return {name: TransferEngine(caches, host, copier=c) for name, c in made.items()}


def bench_shape(
    shape: Shape, args: argparse.Namespace, device: str, pattern: str, layout: str
) -> list[dict]:
    caches = make_caches(shape, args.device_blocks, device, layout)
    host = HostBuffer.for_kv_caches(
        caches, args.host_blocks, pin=False if args.unpinned else None
    )
    host.tensor.fill_(2)
    engines = copiers(caches, host, device, args.staged_chunks)
    n = min(args.batch, args.device_blocks, args.host_blocks)
    gen = torch.Generator().manual_seed(0)
    if pattern == "scattered":  # every block on its own: the worst case
        d_ids = torch.randperm(args.device_blocks, generator=gen)[:n]
        h_ids = torch.randperm(args.host_blocks, generator=gen)[:n]
    elif pattern.startswith("host-runs-"):
        # offload_block_size of k device blocks: device blocks scattered as vLLM
        # allocates them, host slots in runs of k (one host block), the runs scattered.
        k = int(pattern.removeprefix("host-runs-"))
        d_ids = torch.randperm(args.device_blocks, generator=gen)[:n]
        units = torch.randperm(args.host_blocks // k, generator=gen)[: n // k]
        h_ids = (units[:, None] * k + torch.arange(k)).flatten()
        n = len(h_ids)
        d_ids = d_ids[:n]
    else:  # one request's prefix into freshly allocated host blocks
        d_ids = torch.arange(n) + (args.device_blocks - n) // 2
        h_ids = torch.arange(n)
    d_list, h_list = d_ids.tolist(), h_ids.tolist()
    nbytes = n * shape.layers * shape.page_bytes

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
    dst_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=host.pinned).fill_(4)
    # (device run, host run) views of every block: what a per-block loop copies.
    runs = []
    for name, t in caches.items():
        lay = host.layouts[name]
        for d, h in zip(d_list, h_list, strict=True):
            dev = lay.block_view(t, d)
            hv = host.layer_view(name)[h].view(lay.num_chunks, lay.chunk_bytes)
            runs += [(dev[c], hv[c]) for c in range(lay.num_chunks)]

    def engine_copy(engine: TransferEngine, to_host: bool) -> Callable[[], None]:
        return lambda: engine.copy_blocks(to_host, d_ids, h_ids)

    def loop(to_host: bool) -> Callable[[], None]:
        def run() -> None:
            for dev, hv in runs:
                if to_host:
                    hv.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(hv, non_blocking=True)

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
        for name, engine in engines.items():
            methods[f"{direction}/{name}"] = (engine_copy(engine, to_host), nbytes)
        methods[f"{direction}/loop"] = (loop(to_host), nbytes)
        methods[f"{direction}/memcpy"] = (memcpy(to_host), nbytes)
    if device == "cuda":
        for name, engine in engines.items():
            both = _both(engine_copy(engine, True), engine_copy(engine, False))
            methods[f"both/{name}"] = (both, 2 * nbytes)
        methods["both/memcpy"] = (_both(memcpy(True), memcpy(False)), 2 * nbytes)

    timer = Timer(device)
    times: dict[str, list[float]] = {k: [] for k in methods}
    for fn, _ in methods.values():  # warm-up: compile, fault pages
        timer(fn)
    for _ in range(args.reps):
        for key, (fn, _) in methods.items():
            times[key].append(timer(fn))

    label = shape.name if device != "cuda" else f"{shape.name} {layout}"
    rows = []
    for key, (_, moved) in methods.items():
        direction, method = key.split("/")
        limit = times[f"{direction}/memcpy"]
        ratio = statistics.median(m / t for m, t in zip(limit, times[key], strict=True))
        rows.append(
            {
                "shape": label,
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
    # On CPU copies never run beside compute.
    if device == "cuda" and pattern == "scattered":
        copies = [m for m in (*engines, "memcpy")]
        if host.pinned:  # unpinned copies hold the host: nothing runs beside them
            rows += matmul_slowdown(label, methods, copies, timer, device)
        for row in queue_cost(engines, caches, n):
            rows.append({"shape": label, "ids": pattern, "direction": "load", **row})
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
    label: str,
    methods: dict[str, tuple[Callable[[], None], int]],
    copies: list[str],
    timer: Timer,
    device: str,
) -> list[dict]:
    """Time of a matmul loop while each copy method runs beside it, over its time alone.

    Median of 5 each. The copies queued beside it outlast the matmul loop, so every
    matmul runs next to a copy.
    """
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    iters = 50

    def matmuls() -> None:
        for _ in range(iters):
            a @ a

    timer(matmuls)
    alone = statistics.median(_beside(matmuls, None) for _ in range(5))
    rows = []
    for key in [f"{d}/{c}" for d in ("store", "load") for c in copies]:
        copy = methods[key][0]
        with_copies = statistics.median(_beside(matmuls, copy) for _ in range(5))
        rows.append(
            {
                "shape": label,
                "ids": "scattered",
                "direction": key.split("/")[0],
                "method": f"matmul beside {key.split('/')[1]}",
                "slowdown": with_copies / alone,
                "matmul_alone_s": alone,
            }
        )
    return rows


def _beside(main: Callable[[], None], copy: Callable[[], None] | None) -> float:
    """Seconds of `main` on the current stream (CUDA events) while copies run on
    another."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    if copy is not None:
        with torch.cuda.stream(stream):
            for _ in range(8):  # queue enough copies to overlap the whole matmul loop
                copy()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    main()
    end.record()
    end.synchronize()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def sweep(args: argparse.Namespace) -> list[dict]:
    """CUDA only: GB/s of the Triton kernel over its launch constants, 8B shape, flash
    layout."""
    from vllm_cpu_offload.worker.copiers import triton_kernels as copy_kernels

    rows = []
    shape = SHAPES["llama3-8b"]
    caches = make_caches(shape, args.device_blocks, "cuda", "flash")
    host = HostBuffer.for_kv_caches(caches, args.host_blocks)
    n = min(args.batch, args.device_blocks, args.host_blocks)
    d = torch.randperm(args.device_blocks)[:n].cuda()
    h = torch.randperm(args.host_blocks)[:n].cuda()
    timer = Timer("cuda")
    defaults = (
        copy_kernels.BLOCK_WORDS,
        copy_kernels.NUM_WARPS,
        copy_kernels.NUM_PROGRAMS,
    )
    for programs in (8, 16, 24, 32, 64, 132, 1024):
        for block_words, warps in ((512, 2), (1024, 4), (2048, 4), (2048, 8)):
            copy_kernels.BLOCK_WORDS, copy_kernels.NUM_WARPS = block_words, warps
            copy_kernels.NUM_PROGRAMS = programs
            copier = copy_kernels.TritonBlockCopier(caches, host)
            for to_host in (True, False):
                timer(lambda: copier.copy(to_host, d, h))  # noqa: B023
                best = min(
                    timer(lambda: copier.copy(to_host, d, h))  # noqa: B023
                    for _ in range(args.reps)
                )
                gbps = n * shape.layers * shape.page_bytes / best / 1e9
                rows.append(
                    {
                        "programs": programs,
                        "block_words": block_words,
                        "num_warps": warps,
                        "direction": "store" if to_host else "load",
                        "gb_per_s": gbps,
                    }
                )
                print(
                    f"programs={programs:5d} BLOCK_WORDS={block_words:5d} "
                    f"num_warps={warps} {rows[-1]['direction']:5s} {gbps:7.2f} GB/s"
                )
    copy_kernels.BLOCK_WORDS, copy_kernels.NUM_WARPS, copy_kernels.NUM_PROGRAMS = (
        defaults
    )
    return rows


def run_sweep(args: argparse.Namespace) -> list[dict]:
    """CUDA only: GB/s of DMA (1 to 16 streams) and Triton copies against run length.

    256 scattered blocks of 8 layers, one tensor per layer and one run per block: the
    run length is the block's size. This sets `copiers/select.py`'s `DMA_MIN_RUN_BYTES`.
    """
    from vllm_cpu_offload.worker.copiers import dma
    from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

    rows = []
    timer = Timer("cuda")
    n, layers, blocks = 256, 8, 1024
    default_streams = dma.NUM_STREAMS
    for run_bytes in (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10):
        caches = {
            f"l{i}": torch.ones(
                blocks, run_bytes // 2, dtype=torch.bfloat16, device="cuda"
            )
            for i in range(layers)
        }
        host = HostBuffer.for_kv_caches(caches, blocks)
        d = torch.randperm(blocks)[:n]
        h = torch.randperm(blocks)[:n]
        nbytes = n * layers * run_bytes
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        dmas = {}
        for streams in (1, 4, 8, 16):
            dma.NUM_STREAMS = streams
            dmas[f"dma{streams}"] = dma.DmaBlockCopier(caches, host)
        dma.NUM_STREAMS = default_streams
        tri = TritonBlockCopier(caches, host)
        d_dev, h_dev = d.cuda(), h.cuda()
        for to_host in (True, False):
            fns: dict[str, Callable[[], None]] = {
                name: lambda c=c: c.copy(to_host, d, h)  # type: ignore[misc]  # noqa: B023
                for name, c in dmas.items()
            }
            fns["triton"] = lambda: tri.copy(to_host, d_dev, h_dev)  # noqa: B023
            fns["memcpy"] = (
                (lambda: dst.copy_(src, non_blocking=True))  # noqa: B023
                if to_host
                else (lambda: src.copy_(dst, non_blocking=True))  # noqa: B023
            )
            best = {}
            for name, fn in fns.items():
                timer(fn)
                best[name] = min(timer(fn) for _ in range(args.reps))
            direction = "store" if to_host else "load"
            row = {"run_bytes": run_bytes, "direction": direction}
            row |= {f"{k}_gb_per_s": nbytes / v / 1e9 for k, v in best.items()}
            rows.append(row)
            print(
                f"run {run_bytes >> 10:4d} KiB {direction:5s} "
                + " ".join(f"{k} {nbytes / v / 1e9:6.2f}" for k, v in best.items())
                + " GB/s"
            )
    return rows


def queue_cost(
    engines: dict[str, TransferEngine], caches: dict[str, torch.Tensor], n: int
) -> list[dict]:
    """CUDA: host microseconds to queue one layer's load of `n` blocks (the step's
    per-layer loop), and a store of `n` blocks of every layer (the end of a step)."""
    rows = []
    d = torch.randperm(n)
    h = torch.randperm(n)
    for name, engine in engines.items():
        copier = engine.copiers.loads
        on_host = getattr(copier, "ids_on_host", False)
        dd, hh = (d, h) if on_host else (d.cuda(), h.cuda())
        names = list(caches)
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for layer in names:
                copier.copy(False, dd, hh, [layer])
            per_layer = (time.perf_counter() - start) / len(names)
            torch.cuda.synchronize()
            start = time.perf_counter()
            copier.copy(False, dd, hh)
            load = time.perf_counter() - start
            torch.cuda.synchronize()
            start = time.perf_counter()
            copier.copy(True, dd, hh)
            store = time.perf_counter() - start
        torch.cuda.synchronize()
        rows.append(
            {
                "method": name,
                "queue_us_per_layer": per_layer * 1e6,
                "queue_us_load": load * 1e6,
                "queue_us_store": store * 1e6,
            }
        )
        print(
            f"host time to queue {n} blocks, {name}: one layer's load "
            f"{per_layer * 1e6:.0f} us, a load of every layer {load * 1e6:.0f} us, a "
            f"store of every layer {store * 1e6:.0f} us"
        )
    return rows


def measure_in_vllm_worker(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """(machine, rows) of the CPU measurement run inside the worker of a real vLLM
    engine (the package's tiny model, offloading on) through `collective_rpc`."""
    # collective_rpc sends a function by pickle only with this set; it
    # stays on loopback.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    llm = LLM(
        str(ensure_tiny_llama()),
        enforce_eager=True,
        block_size=32,
        num_gpu_blocks_override=64,
        max_model_len=512,
        enable_cpu_offload=True,
        swap_space=0.05,
    )
    try:
        (result,) = llm.collective_rpc(_measure_here, args=(vars(args),))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return result


def _measure_here(worker: object, options: dict) -> tuple[dict, list[dict]]:
    """Runs in the vLLM worker process: imports this file there by path."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import transfer

    from vllm_cpu_offload.worker.copiers.copy_threads import copy_cores

    args = argparse.Namespace(**options)
    info = transfer.machine("cpu") | {
        "in_vllm_worker": True,
        "caller_cores": sorted(os.sched_getaffinity(0)),
        "copy_cores": copy_cores(),
    }
    rows = []
    for name in args.shapes:
        for pattern in args.ids:
            rows += transfer.bench_shape(
                transfer.SHAPES[name], args, "cpu", pattern, "lbhnc"
            )
    return info, rows


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
        f"{'shape':20s} {'ids':9s} {'dir':5s} {'method':20s} {'blocks':>6s} "
        f"{'MiB':>6s} {'GB/s':>6s} {'vs memcpy':>9s}"
    )
    for r in rows:
        head = f"{r['shape']:20s} {r['ids']:9s} {r['direction']:5s} {r['method']:20s}"
        if "queue_us_per_layer" in r:
            continue
        if "slowdown" in r:
            print(f"{head} {'':>6s} {'':>6s} {'':>6s} x{r['slowdown']:.2f} time")
            continue
        print(
            f"{head} {r['blocks']:6d} {r['bytes'] / 2**20:6.0f} {r['gb_per_s']:6.2f} "
            f"{r['vs_memcpy']:9.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES)
    )
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
    parser.add_argument(
        "--host-runs",
        nargs="*",
        type=int,
        default=[],
        help="also host slots in runs of K (host blocks of K device blocks), "
        "device scattered",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--sweep", action="store_true", help="sweep Triton constants (CUDA)"
    )
    parser.add_argument(
        "--run-sweep", action="store_true", help="DMA vs Triton by run length"
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        choices=["lbhnc", "flash"],
        help="CUDA only",
    )
    parser.add_argument(
        "--in-vllm-worker",
        action="store_true",
        help="CPU: measure inside a vLLM worker",
    )
    parser.add_argument(
        "--staged-chunks",
        nargs="+",
        type=int,
        default=[8],
        help="CUDA: blocks per chunk of the staged copiers (one copier pair per value)",
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="CUDA: a host buffer left unpinned (a tier on a disk file system): "
        "the bounce copier against torch copies",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.in_vllm_worker:
        info, rows = measure_in_vllm_worker(args)
        print(
            f"in a vLLM worker: caller cores {info['caller_cores']}, copy cores "
            f"{info['copy_cores']}, torch threads {info['torch_threads']}"
        )
        print_table(rows)
        in_worker = {"machine": info, "args": vars(args) | {"out": None}, "rows": rows}
        write_result(in_worker, args.out or RESULTS / "transfer_cpu_vllm_worker.json")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"machine": machine(device), "args": vars(args) | {"out": None}}
    if args.sweep:
        result["sweep"] = sweep(args)
    if args.run_sweep:
        result["run_sweep"] = run_sweep(args)
    layouts = args.layouts or (["lbhnc", "flash"] if device == "cuda" else ["lbhnc"])
    rows = []
    for name in args.shapes:
        for layout in layouts:
            for pattern in [*args.ids, *(f"host-runs-{k}" for k in args.host_runs)]:
                rows += bench_shape(SHAPES[name], args, device, pattern, layout)
    result["rows"] = rows
    print_table(rows)
    write_result(result, args.out or RESULTS / f"transfer_{device}.json")


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
