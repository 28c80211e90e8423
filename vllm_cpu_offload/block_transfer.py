"""One transfer job, the same object from the scheduler half to the copiers.

The scheduler half plans it, the step's metadata carries it to every worker, the
transfer engine validates it and hands its ids to a copier. Imports nothing, so the
worker's transfer engine runs where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockTransfer:
    """Copy `device_block_ids[i]` <-> `host_block_ids[i]` for every layer.

    Attributes:
        job_id: unique per connector; workers report jobs by it.
        device_block_ids: device KV cache block ids (a list, or an int64 tensor).
        host_block_ids: host buffer block ids, one per device block.
        req_id: the request the job belongs to ("" where no request is involved).

    """

    job_id: int
    device_block_ids: Sequence[int]
    host_block_ids: Sequence[int]
    req_id: str = ""
