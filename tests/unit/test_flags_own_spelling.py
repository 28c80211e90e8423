"""A vLLM that spells `--enable-cpu-offload` / `--swap-space` itself (the upstream
series' [8/8] adds them to EngineArgs as a spelling of `--kv-offloading-size`) must not
also turn on its own connector while the plugin serves the flags: during vLLM's own
`create_engine_config` its fields read off, and they are restored afterwards."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from vllm_cpu_offload import flags


@dataclasses.dataclass
class _EngineArgsWithOwnSpelling:
    model: str = "m"
    enable_cpu_offload: bool = False
    swap_space: float | None = None


@dataclasses.dataclass
class _EngineArgsWithout:
    model: str = "m"


def test_vllms_own_fields_read_off_while_the_plugin_serves_them() -> None:
    args = _EngineArgsWithOwnSpelling(enable_cpu_offload=True, swap_space=2.0)
    with flags._vllms_own_flags_off(args, plugin_serves=True):
        assert (args.enable_cpu_offload, args.swap_space) == (False, None)
    assert (args.enable_cpu_offload, args.swap_space) == (True, 2.0)


def test_the_fields_come_back_when_vllms_config_raises() -> None:
    args = _EngineArgsWithOwnSpelling(enable_cpu_offload=True, swap_space=2.0)
    with pytest.raises(ValueError), flags._vllms_own_flags_off(args, True):
        raise ValueError("vLLM refused the config")
    assert (args.enable_cpu_offload, args.swap_space) == (True, 2.0)


def test_nothing_changes_when_the_plugin_does_not_serve_or_vllm_has_no_fields() -> None:
    args = _EngineArgsWithOwnSpelling(enable_cpu_offload=True, swap_space=2.0)
    with flags._vllms_own_flags_off(args, plugin_serves=False):
        assert (args.enable_cpu_offload, args.swap_space) == (True, 2.0)
    # vLLM 0.32 / 0.33: the plugin's own attributes, not vLLM's fields, stay as set.
    plain = _EngineArgsWithout()
    plain.enable_cpu_offload = True  # type: ignore[attr-defined]
    with flags._vllms_own_flags_off(plain, plugin_serves=True):
        assert plain.enable_cpu_offload is True  # type: ignore[attr-defined]


def test_on_this_vllm_the_flags_are_the_plugins_alone() -> None:
    # vLLM 0.32 and 0.33 declare neither field: the guard leaves the plugin's alone.
    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert not names & set(flags._VLLM_SPELLINGS), "this vLLM spells the flags itself"
    # The plugin's __init__ takes the flags (vLLM's own signature does not).
    args: Any = EngineArgs(model="m", enable_cpu_offload=True, swap_space=1.0)  # type: ignore[call-arg]
    with flags._vllms_own_flags_off(args, plugin_serves=True):
        assert args.enable_cpu_offload is True  # not vLLM's field: the plugin's own
