"""vLLM's CPU executor reserves a core for any KV connector; ours gets the cores of no
connector."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.utils.ompmultiprocessing import OMPProcessManager  # noqa: E402

from vllm_cpu_offload import plugin  # noqa: E402
from vllm_cpu_offload.config import CONNECTOR_NAME  # noqa: E402

plugin.register()


def _config(connector: str | None, world_size: int = 1) -> Any:
    parallel = SimpleNamespace(
        local_world_size=world_size,
        data_parallel_rank_local=None,
        _api_process_count=1,
        assigned_physical_gpu_ids=None,  # read by vLLM 0.33's manager
    )
    ktc = (
        None
        if connector is None
        else KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    )
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=ktc)


def _manager(config: Any, monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    for name in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return OMPProcessManager(config)


@pytest.mark.parametrize("world_size", [1, 2])
def test_our_connector_reserves_what_no_connector_reserves(
    monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    # Same reservation and the same cores per rank as vLLM without any connector.
    bind = "0|1" if world_size == 2 else "0"
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
    none = _manager(_config(None, world_size), monkeypatch, **env)
    ours = _manager(_config(CONNECTOR_NAME, world_size), monkeypatch, **env)
    assert ours.reserve_cpu_num == none.reserve_cpu_num
    assert ours.cpu_lists == none.cpu_lists


def test_other_connectors_keep_vllms_extra_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The patch is scoped to our connector: NIXL's transfer threads still
    # get their core.
    none = _manager(_config(None), monkeypatch)
    nixl = _manager(_config("NixlConnector"), monkeypatch)
    assert nixl.reserve_cpu_num == none.reserve_cpu_num + 1


def test_auto_binding_gives_our_connector_the_cores_of_no_connector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's automatic binding on this machine: the same core list with and without.
    none = _manager(_config(None), monkeypatch)
    ours = _manager(_config(CONNECTOR_NAME), monkeypatch)
    assert (
        ours.cpu_lists == none.cpu_lists
        and ours.reserved_cpu_list == none.reserved_cpu_list
    )


def test_users_reserved_cpu_setting_still_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # VLLM_CPU_NUM_OF_RESERVED_CPU is the user's word, with or without the flag.
    ours = _manager(
        _config(CONNECTOR_NAME), monkeypatch, VLLM_CPU_NUM_OF_RESERVED_CPU="0"
    )
    assert ours.reserve_cpu_num == 0
