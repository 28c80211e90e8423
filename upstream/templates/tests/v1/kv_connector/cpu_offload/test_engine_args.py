# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host-tier engine flags: EngineArgs fields, the parser, what they resolve to."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.cpu_offload.config import (
    CONNECTOR_NAME,
    DEFAULT_SWAP_SPACE_GIB,
    OffloadConfigError,
)
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser


def parse(model: str, *argv: str) -> EngineArgs:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", model, *argv]))


def test_flags_are_engine_args_fields(tiny_model: str) -> None:
    # The flags reach LLM(...) and AsyncEngineArgs as keyword arguments.
    args = AsyncEngineArgs(model=tiny_model, enable_cpu_offload=True, swap_space=8)
    assert args.enable_cpu_offload and args.swap_space == 8
    off = EngineArgs(model=tiny_model)
    assert off.enable_cpu_offload is False and off.swap_space is None


def test_flags_parse_from_the_command_line(tiny_model: str) -> None:
    args = parse(tiny_model, "--enable-cpu-offload", "--swap-space", "0.5")
    assert args.enable_cpu_offload and float(args.swap_space) == 0.5
    assert parse(tiny_model).enable_cpu_offload is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--swap-space", "8"), "needs --enable-cpu-offload"),
        (("--enable-cpu-offload", "--swap-space", "0"), "must be a positive number"),
        (("--enable-cpu-offload", "--swap-space", "eight"), "must be a number of GiB"),
        (("--enable-cpu-offload", "--swap-space", "1e9"), "exceeds"),
        (
            ("--enable-cpu-offload", "--kv-offloading-size", "4"),
            "drop --kv-offloading-size",
        ),
    ],
)
def test_bad_flags_exit_with_one_line(
    tiny_model: str,
    argv: tuple[str, ...],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Refused before anything starts, with one line that names the fix.
    with pytest.raises(SystemExit) as exit_info:
        parse(tiny_model, *argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_enable_resolves_to_the_connector(tiny_model: str) -> None:
    config = EngineArgs(
        model=tiny_model, enable_cpu_offload=True, swap_space=0.01
    ).create_engine_config()
    ktc = config.kv_transfer_config
    assert ktc is not None and ktc.kv_connector == CONNECTOR_NAME
    assert ktc.kv_role == "kv_both"
    assert ktc.kv_load_failure_policy == "recompute"
    assert ktc.kv_connector_extra_config["swap_space_gib"] == 0.01


def test_enable_alone_gets_the_default_size(tiny_model: str) -> None:
    config = EngineArgs(
        model=tiny_model, enable_cpu_offload=True
    ).create_engine_config()
    extra = config.kv_transfer_config.kv_connector_extra_config
    assert extra["swap_space_gib"] == DEFAULT_SWAP_SPACE_GIB


def test_off_leaves_the_config_as_before(tiny_model: str) -> None:
    assert (
        EngineArgs(model=tiny_model).create_engine_config().kv_transfer_config is None
    )
    with pytest.raises(OffloadConfigError, match="needs --enable-cpu-offload"):
        EngineArgs(model=tiny_model, swap_space=8).create_engine_config()
