"""MLA-style KV in the simulation: every rank of an engine holds the same KV.

The product decides this from vLLM's model config (`kv_is_replicated`); the simulated
model is a Llama, so the decision is patched where the product reads it. The ranks of
one engine run in this one process, so the host region they share is one tensor per
engine (by its region's name, which carries the engine id) instead of a memory file
every rank maps, and the ranks agree without a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

import vllm_cpu_offload.kv_identity as kv_identity_module
import vllm_cpu_offload.worker.region_layer as region_layer


class SimSharedRegion:
    """`SharedRegion` for ranks that are objects of one process: one tensor per
    region name, made by the first rank that maps it."""

    tensors: dict[str, torch.Tensor] = {}

    shared = True

    def __init__(self, name: str, collectives: object, *, leader: bool) -> None:
        self.name = name
        self.leader = leader
        self.copies_stores = leader

    def pin(self, tensor: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        pass

    def map(
        self, num_slots: int, slot_bytes: int, layouts: dict[str, str]
    ) -> torch.Tensor:
        tensor = self.tensors.get(self.name)
        if tensor is None:
            tensor = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8)
            self.tensors[self.name] = tensor
        assert tensor.shape == (num_slots, slot_bytes), "ranks disagree on the tier"
        return tensor


@contextlib.contextmanager
def replicated_kv(on: bool) -> Iterator[None]:
    """While open, engines built think their KV replicated (`on`) or sharded."""
    if not on:
        yield
        return

    def replicated(_: Any) -> bool:
        return True

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(kv_identity_module, "kv_is_replicated", replicated)
        )
        stack.enter_context(
            mock.patch.object(region_layer, "SharedRegion", SimSharedRegion)
        )
        stack.enter_context(
            mock.patch.object(region_layer, "TensorParallelCollectives", lambda: None)
        )
        yield
