"""The two engine flags and the advanced route: what they turn into, and every bad
input."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from vllm_cpu_offload import flags, plugin  # noqa: E402
from vllm_cpu_offload.config import (  # noqa: E402
    CONNECTOR_NAME,
    DEFAULT_SWAP_SPACE_GIB,
    OffloadConfig,
)
from vllm_cpu_offload.errors import OffloadConfigError  # noqa: E402

plugin.register()


def _args(**kwargs: object) -> EngineArgs:
    return EngineArgs(model="unused", **kwargs)  # type: ignore[arg-type]


def test_flags_off_leave_engine_args_alone() -> None:
    # No flag: no offload config, no connector.
    assert flags.resolve_offload(_args()) is None


def test_enable_alone_uses_default_size() -> None:
    # --enable-cpu-offload alone: the default host size.
    config = flags.resolve_offload(_args(enable_cpu_offload=True))
    assert config == OffloadConfig(swap_space_gib=DEFAULT_SWAP_SPACE_GIB)


def test_enable_with_size() -> None:
    # --enable-cpu-offload --swap-space 0.5: that size.
    config = flags.resolve_offload(_args(enable_cpu_offload=True, swap_space="0.5"))
    assert config is not None and config.swap_space_gib == 0.5


def test_cli_parser_has_both_flags_and_builds_engine_args() -> None:
    # vllm serve's parser learns both flags; from_cli_args carries them over.
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(
        ["--model", "m", "--enable-cpu-offload", "--swap-space", "2"]
    )
    engine_args = AsyncEngineArgs.from_cli_args(ns)
    assert engine_args.enable_cpu_offload is True
    assert engine_args.swap_space == "2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enable_cpu_offload": True, "swap_space": "-1"}, "positive number of GiB"),
        ({"enable_cpu_offload": True, "swap_space": "0"}, "positive number of GiB"),
        ({"enable_cpu_offload": True, "swap_space": "lots"}, "must be a number of GiB"),
        ({"enable_cpu_offload": True, "swap_space": "nan"}, "positive number of GiB"),
        ({"enable_cpu_offload": True, "swap_space": "1000000"}, "lower --swap-space"),
        ({"swap_space": "2"}, "needs --enable-cpu-offload"),
        (
            {"swap_space_remote": "redis://127.0.0.1:6379"},
            "--swap-space-remote puts a shared store behind the host KV tier",
        ),
        (
            {"enable_cpu_offload": True, "swap_space_remote": "memcached://h:1"},
            "memcached",
        ),
        (
            {"enable_cpu_offload": True, "swap_space_remote": "redis://u:pw@h:6379"},
            "VLLM_CPU_OFFLOAD_REMOTE_PASSWORD",
        ),
        (
            {"swap_space_path": "/tmp/tier"},
            "--swap-space-path keeps the host KV tier in files",
        ),
        (
            {"enable_cpu_offload": True, "swap_space_path": ""},
            "must be a directory path",
        ),
        (
            {"enable_cpu_offload": True, "kv_offloading_size": 4.0},
            "--kv-offloading-size",
        ),
        (
            {
                "enable_cpu_offload": True,
                "kv_transfer_config": KVTransferConfig(
                    kv_connector="ExampleConnector", kv_role="kv_both"
                ),
            },
            "cannot be combined with the KV connector 'ExampleConnector'",
        ),
        (
            {
                "kv_transfer_config": KVTransferConfig(
                    kv_connector=CONNECTOR_NAME,
                    kv_role="kv_both",
                    kv_connector_extra_config={"swap_space_gib": 1, "colour": "red"},
                )
            },
            "unknown key(s) 'colour'",
        ),
        (
            {
                "kv_transfer_config": KVTransferConfig(
                    kv_connector=CONNECTOR_NAME,
                    kv_role="kv_both",
                    kv_connector_extra_config={"eviction_policy": "mru"},
                )
            },
            "choose one of: prefix_aware, lru",
        ),
        (
            {
                "kv_transfer_config": KVTransferConfig(
                    kv_connector=CONNECTOR_NAME,
                    kv_role="kv_both",
                    kv_connector_extra_config={"copy_backend": "nccl"},
                )
            },
            "copy_backend 'nccl' is not known; choose one of: auto, triton, dma, "
            "staged",
        ),
    ],
)
def test_bad_input_is_one_line_error(kwargs: dict[str, object], message: str) -> None:
    # Each bad input: a ValueError of one line that names the fix.
    with pytest.raises(OffloadConfigError) as info:
        flags.resolve_offload(_args(**kwargs))
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_swap_space_path_from_the_command_line(tmp_path: Path) -> None:
    # --swap-space-path DIR: parsed, carried to the config; the directory
    # is created private.
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    tier = tmp_path / "tier"
    ns = parser.parse_args(
        ["--model", "m", "--enable-cpu-offload", "--swap-space", "0.01",
         "--swap-space-path", str(tier)]
    )  # fmt: skip
    config = flags.resolve_offload(AsyncEngineArgs.from_cli_args(ns))
    assert config is not None and config.swap_space_path == str(tier)
    assert config.to_extra_config()["swap_space_path"] == str(tier)
    assert stat.S_IMODE(tier.stat().st_mode) == 0o700


def test_a_directory_others_can_write_is_refused_before_start(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(OffloadConfigError, match="writable by other users"):
        flags.resolve_offload(
            _args(enable_cpu_offload=True, swap_space_path=str(shared))
        )


def test_advanced_route_validates_and_keeps_extra_config() -> None:
    # --kv-transfer-config naming our connector: its extra config is the config.
    ktc = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_both",
        kv_connector_extra_config={
            "swap_space_gib": 0.25,
            "eviction_policy": "lru",
            "copy_backend": "dma",
        },
    )
    config = flags.resolve_offload(_args(kv_transfer_config=ktc))
    assert config == OffloadConfig(
        swap_space_gib=0.25, eviction_policy="lru", copy_backend="dma"
    )


def test_flags_keep_the_advanced_routes_other_keys_and_recompute_failed_loads() -> None:
    # --enable-cpu-offload --swap-space over an explicit config: the size changes, the
    # rest stays; a failed load is a recompute (vLLM's default would fail the request).
    ktc = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_both",
        kv_connector_extra_config={"eviction_policy": "lru", "copy_backend": "dma"},
    )
    args = _args(enable_cpu_offload=True, swap_space="0.5", kv_transfer_config=ktc)
    config = flags.resolve_offload(args)
    assert config == OffloadConfig(
        swap_space_gib=0.5, eviction_policy="lru", copy_backend="dma"
    )
    built = flags._kv_transfer_config_for(config, ktc)
    assert built.kv_load_failure_policy == "recompute"
    assert built.kv_connector_extra_config["copy_backend"] == "dma"


def test_version_check_takes_the_tested_releases_and_refuses_others() -> None:
    # The patch takes the releases it is tested against (any local build of them) and
    # refuses any other, naming the supported ones and what to install.
    for version in ("0.32.0", "0.32.0+cpu", "0.33.0", "0.33.0+cu130"):
        flags.check_vllm_version(version)
    for version in ("0.31.2", "0.33.1", "0.34.0", "0.33.0rc1"):
        with pytest.raises(
            RuntimeError, match="supports vLLM 0.32.0 and 0.33.0 but vLLM 0"
        ):
            flags.check_vllm_version(version)
    assert "install vllm==0.33.0" in (flags.unsupported_vllm("0.34.0") or "")


def test_an_untested_vllm_release_is_left_as_it_is() -> None:
    # On a vLLM release the package is not tested against, the plugin patches nothing
    # (vLLM runs as without the package) and says once which releases it supports.
    script = (
        "import vllm; vllm.__version__ = '0.34.0'\n"
        "from vllm_cpu_offload import flags, omp_cores, plugin\n"
        "plugin.register(); plugin.register()\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "print('RESULT', flags.applied(), omp_cores.applied(), "
        "hasattr(EngineArgs(model='m'), 'enable_cpu_offload'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_PLUGINS": "none"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "RESULT False False False" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "supports vLLM" in line]
    assert len(warnings) == 1, proc.stderr
    assert "vLLM 0.34.0 is installed; install vllm==0.33.0" in warnings[0]


@pytest.fixture(scope="module")
def state_space_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Jamba config (Mamba layers between attention layers) with the tiny tokenizer.

    vLLM 0.32's CPU platform cannot run one (its Mamba mixer fails in the first
    forward), so the flags refuse such models before the engine starts.
    """
    from transformers import JambaConfig

    folder = tmp_path_factory.mktemp("jamba")
    JambaConfig(
        vocab_size=4262,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=1,
        expert_layer_period=100,
        expert_layer_offset=99,
        use_mamba_kernels=False,
    ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(tiny_model) / name, folder)
    return str(folder)


def test_state_space_model_is_refused_before_the_engine_starts(
    state_space_model: str,
) -> None:
    # LLM(...) and EngineArgs: a one-line OffloadConfigError from create_engine_config.
    args = EngineArgs(
        model=state_space_model, enable_cpu_offload=True, swap_space="0.01"
    )  # type: ignore[call-arg]
    with pytest.raises(OffloadConfigError, match="hybrid state-space") as info:
        args.create_engine_config()
    assert "\n" not in str(info.value) and "drop --enable-cpu-offload" in str(
        info.value
    )
    # Nor does the shared tier take it.
    args = EngineArgs(
        model=state_space_model,
        enable_cpu_offload=True,
        swap_space="0.01",
        swap_space_remote="redis://127.0.0.1:6379",
    )  # type: ignore[call-arg]
    with pytest.raises(OffloadConfigError, match="hybrid state-space"):
        args.create_engine_config()
    # Without the flag nothing is refused: vLLM decides on its own.
    EngineArgs(model=state_space_model).create_engine_config()


def test_state_space_model_on_the_command_line_is_one_line_and_exit_2(
    state_space_model: str,
) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", state_space_model,
            "--enable-cpu-offload", "--swap-space", "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --enable-cpu-offload holds attention KV blocks"), (
        last
    )


def _extra(**extra: object) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_connector_extra_config=extra
    )


@pytest.mark.parametrize("size", [0, -32, 1.5, "64", True])
def test_offload_block_size_must_be_a_positive_number_of_tokens(size: object) -> None:
    with pytest.raises(
        OffloadConfigError, match="offload_block_size must be a positive number"
    ):
        flags.resolve_offload(_args(kv_transfer_config=_extra(offload_block_size=size)))


def test_offload_block_size_is_checked_against_the_engine_before_start(
    tiny_model: str,
) -> None:
    # Not a multiple of the block size: refused with the fix; a multiple is taken.
    args = EngineArgs(
        model=tiny_model,
        block_size=32,
        kv_transfer_config=_extra(offload_block_size=48),
    )
    with pytest.raises(
        OffloadConfigError, match="not a multiple of the block size 32"
    ) as info:
        args.create_engine_config()
    assert "\n" not in str(info.value)
    args = EngineArgs(
        model=tiny_model,
        block_size=32,
        kv_transfer_config=_extra(offload_block_size=64),
    )
    config = args.create_engine_config().kv_transfer_config
    assert config is not None
    assert config.kv_connector_extra_config["offload_block_size"] == 64


def test_offload_block_size_refuses_sliding_window_layers(tiny_model: str) -> None:
    import dataclasses

    from vllm_cpu_offload.testing.tiny_model import TEST_SHAPE, ensure_tiny_llama

    model = str(ensure_tiny_llama(dataclasses.replace(TEST_SHAPE, sliding_window=64)))
    args = EngineArgs(
        model=model, block_size=32, kv_transfer_config=_extra(offload_block_size=64)
    )
    with pytest.raises(OffloadConfigError, match="needs full attention"):
        args.create_engine_config()


def test_swap_space_remote_serves_sliding_window_models() -> None:
    # The shared tier takes every model the host tier takes: windowed layers too.
    import dataclasses

    from vllm_cpu_offload.testing.tiny_model import TEST_SHAPE, ensure_tiny_llama

    model = str(ensure_tiny_llama(dataclasses.replace(TEST_SHAPE, sliding_window=64)))
    args = EngineArgs(
        model=model,
        block_size=32,
        enable_cpu_offload=True,
        swap_space="0.01",
        swap_space_remote="redis://127.0.0.1:6379",
    )  # type: ignore[call-arg]
    config = args.create_engine_config().kv_transfer_config
    assert config is not None
    assert config.kv_connector_extra_config["remote_url"] == "redis://127.0.0.1:6379"


def test_swap_space_remote_reaches_the_connector_config() -> None:
    # --swap-space-remote URL: validated without connecting, carried to the extra
    # config; remote_timeout_s from --kv-transfer-config.
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(
        [
            "--model",
            "m",
            "--enable-cpu-offload",
            "--swap-space-remote",
            "mooncake://10.0.0.5:50051",
        ]
    )
    config = flags.resolve_offload(AsyncEngineArgs.from_cli_args(ns))
    assert config is not None and config.remote_url == "mooncake://10.0.0.5:50051"
    assert OffloadConfig.from_extra_config(config.to_extra_config()) == config
    with pytest.raises(OffloadConfigError, match="remote_timeout_s must be a positive"):
        flags.resolve_offload(_args(kv_transfer_config=_extra(remote_timeout_s=0)))


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_async_load_tokens_is_a_count_of_tokens(bad: object) -> None:
    # Absent: the default; 0 loads every host hit inside its step; anything but a
    # count of tokens is refused with the fix.
    assert OffloadConfig.from_extra_config({}).async_load_tokens == 4096
    zero = OffloadConfig.from_extra_config({"async_load_tokens": 0})
    assert zero.async_load_tokens == 0
    assert OffloadConfig.from_extra_config(zero.to_extra_config()) == zero
    with pytest.raises(OffloadConfigError, match="async_load_tokens must be a number"):
        flags.resolve_offload(_args(kv_transfer_config=_extra(async_load_tokens=bad)))


@pytest.mark.parametrize(
    ("key", "bad"),
    [("retain_share", 1.5), ("retain_share", -0.1), ("retain_share", "half"),
     ("retain_share", float("nan")), ("max_retain_s", 0), ("max_retain_s", True)],
)  # fmt: skip
def test_retention_bounds_are_checked(key: str, bad: object) -> None:
    default = OffloadConfig.from_extra_config({})
    assert (default.retain_share, default.max_retain_s) == (0.25, 3600.0)
    none = OffloadConfig.from_extra_config({"retain_share": 0, "max_retain_s": 60})
    assert OffloadConfig.from_extra_config(none.to_extra_config()) == none
    with pytest.raises(OffloadConfigError, match=f"{key} must be"):
        flags.resolve_offload(_args(kv_transfer_config=_extra(**{key: bad})))


def test_remote_values_is_one_of_two() -> None:
    assert OffloadConfig.from_extra_config({}).remote_values == "per_head"
    per_rank = OffloadConfig.from_extra_config({"remote_values": "per_rank"})
    assert OffloadConfig.from_extra_config(per_rank.to_extra_config()) == per_rank
    with pytest.raises(OffloadConfigError, match="remote_values 'rank' is not known"):
        flags.resolve_offload(_args(kv_transfer_config=_extra(remote_values="rank")))


def test_settings_already_validated_are_not_validated_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The command line's from_cli_args and create_engine_config both resolve the same
    # settings: the size is parsed and checked once; changed settings are again.
    calls: list[object] = []
    real = flags.parse_swap_space

    def counted(value: object, name: str = "--swap-space") -> float:
        calls.append(value)
        return real(value, name)

    monkeypatch.setattr(flags, "parse_swap_space", counted)
    args = _args(enable_cpu_offload=True, swap_space="1")
    first = flags.resolve_offload(args)
    assert flags.resolve_offload(args) is first and calls == ["1"]
    args.swap_space = "2"  # type: ignore[attr-defined]  # added by flags.py's patch
    second = flags.resolve_offload(args)
    assert second is not None and second.swap_space_gib == 2 and calls == ["1", "2"]


def _dev_shm_full(
    statvfs: Callable[[str], os.statvfs_result],
) -> Callable[[str], os.statvfs_result]:
    """`os.statvfs` that finds no room left on /dev/shm."""

    def patched(path: str) -> os.statvfs_result:
        fs = statvfs(path)
        if os.fspath(path) != "/dev/shm":
            return fs
        full = (*fs[:3], 0, 0, *fs[5:])  # f_bfree and f_bavail
        return os.statvfs_result(full)

    return patched


def test_replicated_kv_counts_one_host_tier_per_pipeline_stage(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLA's ranks map one region per stage: 1 GiB at TP=2 needs 1 GiB, not 2.
    from vllm_cpu_offload.errors import GIB
    from vllm_cpu_offload.testing.tiny_mla import ENGINE_KWARGS, ensure_tiny_mla

    monkeypatch.setattr(flags, "available_host_memory_bytes", lambda: int(1.5 * GIB))

    def engine(model: str, **kwargs: object) -> EngineArgs:
        return EngineArgs(  # type: ignore[call-arg]  # flags.py's patched __init__
            model=model,
            enable_cpu_offload=True,
            swap_space="1",
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            **kwargs,  # type: ignore[arg-type]
        )

    mla = str(ensure_tiny_mla())
    engine(mla, **ENGINE_KWARGS).create_engine_config()
    # A model with KV heads: each rank holds its own heads' tier.
    with pytest.raises(OffloadConfigError, match=r"1 GiB x 2 worker\(s\) exceeds"):
        engine(tiny_model).create_engine_config()
    # The region is not on /dev/shm: a tmpfs too small for it (docker's 64 MiB) does
    # not matter.
    monkeypatch.setattr(os, "statvfs", _dev_shm_full(os.statvfs))
    engine(mla, **ENGINE_KWARGS).create_engine_config()
    # A persistent tier does not share one: it keeps a file per rank.
    monkeypatch.setattr(flags, "available_host_memory_bytes", lambda: 64 * GIB)
    assert flags.host_tier_copies(
        engine(mla, **ENGINE_KWARGS).create_engine_config(),
        OffloadConfig(swap_space_gib=1, swap_space_path="/tmp"),
    ) == (2, "worker(s)")
