"""With the flags off, vLLM behaves exactly as without the package."""

from __future__ import annotations

import os

import pytest

from tests.e2e.conftest import script_result

pytestmark = pytest.mark.e2e


def _generate(model: str, plugins: str | None) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    return dict(script_result("tests.e2e.generate_tokens", model, env=env, timeout=300))


def test_flags_off_equals_vllm_without_the_plugin(tiny_model: str) -> None:
    # Same prompts, greedy: plugin loaded with flags off vs the plugin not
    # loaded at all.
    with_plugin = _generate(tiny_model, plugins=None)
    without = _generate(tiny_model, plugins="no-such-plugin")
    assert with_plugin["plugin_loaded"] and not without["plugin_loaded"]
    assert with_plugin["tokens"] == without["tokens"]
    assert len(with_plugin["tokens"]) == 3 and all(
        len(t) == 16 for t in with_plugin["tokens"]
    )
    assert (
        not with_plugin["kv_transfer_config"] and not with_plugin["kv_transfer_group"]
    )
