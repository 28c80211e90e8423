"""How fast this CPU multiplies matrices in bf16 and in fp32, for sizing a benchmark.

CPUs differ by two orders of magnitude in bf16: with AMX or AVX512-BF16, torch
multiplies bf16 matrices about twice as fast as fp32 ones; on an AVX2-only CPU (an
AMD EPYC of an older generation, say) about 0.5 GFLOP/s in bf16 against 67 in fp32, on
one core. A demo that runs bf16 everywhere then takes minutes where it should take
seconds. `probe` times one matrix product of the shape a prefill of the benchmark model
runs in each dtype (a fraction of a second each); `choose_dtype` picks the faster.

    python benchmarks/matmul_rate.py     # prints both rates and the choice
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class Rates:
    """GFLOP/s of one (m x k) @ (k x n) product per dtype, at `threads` threads."""

    gflops: dict[str, float]
    threads: int

    def fastest(self) -> str:
        return max(DTYPES, key=lambda d: self.gflops[d])

    def describe(self) -> str:
        rates = ", ".join(f"{d} {self.gflops[d]:.1f}" for d in DTYPES)
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"matmul GFLOP/s on {threads}: {rates}"


def _rate(dtype: str, m: int, k: int, n: int, seconds: float) -> float:
    """GFLOP/s of `m x k @ k x n` in `dtype`, timed for about `seconds` (after one
    warm-up product). A very slow dtype stops after its first timed product."""
    import torch

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(torch_dtype)
    b = torch.randn(k, n, generator=gen).to(torch_dtype)
    torch.mm(a, b)
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * m * k * n * runs / elapsed / 1e9


def probe(
    m: int = 256, k: int = 512, n: int = 1536, seconds: float = 0.3, threads: int = 1
) -> Rates:
    """Both dtypes' rates for the product of a prefill chunk of `m` tokens with a
    `k x n` weight (the benchmark model's MLP), on `threads` threads (one: the figure
    does not depend on how many cores the machine has, or how busy the others are).
    Takes about 2 x `seconds`, more where a single product is slower than that (1.6 s
    at 0.5 GFLOP/s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return Rates({d: _rate(d, m, k, n, seconds) for d in DTYPES}, threads)
    finally:
        torch.set_num_threads(before)


def choose_dtype(rates: Rates) -> str:
    """The dtype the CPU multiplies faster: bf16 on AMX and AVX512-BF16 CPUs, fp32 on
    AVX2-only ones."""
    return rates.fastest()


if __name__ == "__main__":
    found = probe()
    print(found.describe())
    print(f"faster: {choose_dtype(found)}")
