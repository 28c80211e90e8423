"""Reads documents twice, one request at a time, on an engine run as users run it;
prints JSON.

The engine core and the worker run in their own processes (vLLM's default), so vLLM's
CPU executor binds the worker's OpenMP threads exactly as it does for a user. The JSON
holds the greedy tokens and cached-token counts of every request, and the worker's
OpenMP threads and CPU binding, read inside the worker.

    python -m tests.e2e.long_document_run MODEL [--offload [--offload-block-size N]
        [--swap-space-path DIR] [--swap-space-remote URL]] [--dtype bfloat16]
        [--reads 2] [--mla [CPU_MLA|AMX_MLA]] [--documents pydoc]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# collective_rpc sends the probe below by pickle only with this set; it
# stays on loopback.
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

BLOCK_SIZE = 32
OMP_VARIABLES = ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")


def worker_threads(worker: Any) -> dict[str, Any]:
    """The OpenMP threads and binding of the process it runs in (a worker)."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "env": {name: os.environ.get(name) for name in OMP_VARIABLES},
    }


def kv_cache_groups(worker: Any) -> list[str]:
    """The kinds of the KV cache groups the worker's model runner allocated."""
    groups = worker.model_runner.kv_cache_config.kv_cache_groups
    return [type(group.kv_cache_spec).__name__ for group in groups]


def attention_backends(worker: Any) -> list[str]:
    """The attention backends the worker's model runner runs, by vLLM's names."""
    groups = worker.model_runner.attn_groups
    return sorted({g.backend.get_name() for per_group in groups for g in per_group})


def host_tier_memory(worker: Any) -> dict[str, Any]:
    """The worker's host tier: its size, whether every rank maps it, and the file
    (inode) and resident bytes of its mapping where it is a shared region."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_cpu_offload.connector import CPUOffloadConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, CPUOffloadConnector) and connector.worker is not None
    assert connector.worker.engine is not None
    host = connector.worker.engine.host
    start = host.tensor.data_ptr()
    mapping = None
    with open("/proc/self/smaps") as smaps:
        lines = iter(smaps)
        for line in lines:
            fields = line.split()
            if fields[0].endswith(":"):  # a field of the mapping above
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high:
                mapping = {"inode": int(fields[4])}
                for field in lines:  # Rss comes before Pss
                    name, value = field.split()[:2]
                    if name in ("Rss:", "Pss:"):
                        mapping[name[:-1].lower() + "_kib"] = int(value)
                    if name == "Pss:":
                        break
                break
    shared = getattr(host, "shared", False)  # a tier of every rank's own before MLA
    return {"nbytes": host.nbytes, "shared": shared, "mapping": mapping}


def _documents(args: argparse.Namespace) -> list[list[int]]:
    if args.documents == "pydoc":
        from transformers import AutoTokenizer

        from vllm_cpu_offload.testing.pydoc_documents import documents, prompt_token_ids

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        texts = documents(tokenizer, args.docs + 16, args.doc_tokens)
        # Prompts that end inside a block: a prompt of whole blocks hits one block more
        # from host (loaded up to its last token) than on the device (vLLM computes its
        # last block), so its last token would be computed alone in one run and in a
        # block's chunk in the other, which bf16 rounds differently.
        prompts = [prompt_token_ids(tokenizer, doc) for doc in texts]
        return [p for p in prompts if len(p) % BLOCK_SIZE][: args.docs]
    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    rng = random.Random(11)
    return [random_token_ids(rng, args.doc_tokens) for _ in range(args.docs)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=300)
    parser.add_argument("--device-blocks", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--offload-block-size", type=int, help="tokens per host block")
    parser.add_argument("--metrics", action="store_true", help="report vLLM's metrics")
    parser.add_argument(
        "--swap-space-path", help="keep the host tier in files in this directory"
    )
    parser.add_argument(
        "--swap-space-remote", help="a store shared by every engine, behind host memory"
    )
    parser.add_argument(
        "--reads", type=int, default=2, help="times each document is read"
    )
    parser.add_argument(
        "--mla",
        nargs="?",
        const="CPU_MLA",
        choices=("CPU_MLA", "AMX_MLA"),
        help="the model is tiny_mla's: its engine settings for this MLA backend "
        "(CPU_MLA if none is named) and that backend's block size",
    )
    parser.add_argument(
        "--documents",
        default="random",
        choices=("random", "pydoc"),
        help="random token ids, or chat prompts over the Python reference (a real "
        "model's tokenizer)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--swap-space", type=float, default=0.05, help="GiB")
    parser.add_argument(
        "--kv-transfer-params", help="JSON: every request's kv_transfer_params"
    )
    args = parser.parse_args()

    # The flags work as LLM() keyword arguments with no import of the package by the
    # script: the .pth hook applies the plugin when vLLM's arg_utils is imported.
    imported_at_start = "vllm_cpu_offload" in sys.modules
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    applied_by_vllm_import = "vllm_cpu_offload.flags" in sys.modules
    flags: dict[str, Any] = (
        dict(enable_cpu_offload=True, swap_space=args.swap_space)
        if args.offload
        else {}
    )
    if args.swap_space_path:
        flags["swap_space_path"] = args.swap_space_path
    if args.swap_space_remote:
        flags["swap_space_remote"] = args.swap_space_remote
    if args.offload_block_size:
        from vllm.config.kv_transfer import KVTransferConfig

        flags["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"offload_block_size": args.offload_block_size},
        )
    engine: dict[str, Any] = {"block_size": BLOCK_SIZE}
    if args.mla:
        from vllm_cpu_offload.testing import tiny_mla

        engine = (
            {**tiny_mla.AMX_ENGINE_KWARGS, "block_size": tiny_mla.AMX_BLOCK_SIZE}
            if args.mla == "AMX_MLA"
            else {**tiny_mla.ENGINE_KWARGS, "block_size": tiny_mla.BLOCK_SIZE}
        )
    if args.tensor_parallel_size > 1:
        engine["tensor_parallel_size"] = args.tensor_parallel_size
        engine["distributed_executor_backend"] = "mp"
    docs = _documents(args)
    llm = LLM(
        args.model,
        enforce_eager=True,
        **engine,
        num_gpu_blocks_override=args.device_blocks,
        max_model_len=max(map(len, docs)) + 2 * int(engine["block_size"]),
        dtype=args.dtype,
        seed=0,
        disable_log_stats=not args.metrics,
        **flags,
    )
    hints = json.loads(args.kv_transfer_params or "null")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": hints} if hints else None,
    )
    requests = []
    for doc in docs * args.reads:  # every document read `reads` times, one at a time
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False
        )[0]
        requests.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "cached": out.num_cached_tokens or 0,
                "text": out.outputs[0].text,
                "prompt_tokens": len(out.prompt_token_ids or ()),
            }
        )
    threads, *_ = llm.collective_rpc(worker_threads)
    groups, *_ = llm.collective_rpc(kv_cache_groups)
    backends, *_ = llm.collective_rpc(attention_backends)
    regions = llm.collective_rpc(host_tier_memory) if args.offload else []
    metrics = {}
    if args.metrics:
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:cpu_offload_"):
                group = metric.labels.get("kv_cache_group")
                name = metric.name + (f"{{{group}}}" if group is not None else "")
                metrics[name] = getattr(metric, "value", None)
    result = {
        "requests": requests,
        "worker": threads,
        "kv_cache_groups": groups,
        "attention_backends": backends,
        "prefix_caching": bool(
            llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        ),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "host_tier": regions,
        "metrics": metrics,
        "plugin": {"at_start": imported_at_start, "after_vllm": applied_by_vllm_import},
    }
    print("RESULT " + json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
