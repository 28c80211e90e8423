"""A user's eviction policy, named by import path, runs the host tier of a real
engine."""

from __future__ import annotations

import random

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import make_llm, scheduler_connector, shutdown

pytestmark = pytest.mark.e2e

FIFO_PATH = "tests.external_policy.fifo:FIFOPolicy"


def test_policy_class_from_the_extra_config_serves_host_hits(tiny_model: str) -> None:
    from vllm import SamplingParams
    from vllm.config.kv_transfer import KVTransferConfig

    from tests.external_policy.fifo import FIFOPolicy
    from vllm_cpu_offload.testing.tiny_model import random_words

    ktc = KVTransferConfig(
        kv_connector="CPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "swap_space_gib": 0.01,
            "eviction_policy": FIFO_PATH,
        },
    )
    llm = make_llm(tiny_model, offload=False, kv_transfer_config=ktc)
    try:
        sched = scheduler_connector(llm).scheduler
        assert isinstance(sched.pool.policy, FIFOPolicy)
        rng = random.Random(5)
        # overflow the device
        docs = [random_words(rng, 6 * BLOCK_SIZE + 3) for _ in range(5)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for doc in docs + docs[:1]:
            llm.generate([doc], params, use_tqdm=False)
        # the re-read came from host memory
        assert sched.stats.hit_tokens >= 6 * BLOCK_SIZE
        assert sched.pool.policy.accesses > 0
    finally:
        shutdown(llm)
