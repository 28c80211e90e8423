"""vLLM's connector test helpers (`tests/v1/kv_connector/unit/utils.py` of its source
distribution), loaded once per process: the module registers a connector with vLLM's
factory when it runs, and a second run would register it twice."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

# Under another name: this repository's tests package is also called `tests`.
MODULE_NAME = "vllm_kv_connector_test_utils"


def load_connector_test_utils(sdist: Path) -> ModuleType:
    loaded = sys.modules.get(MODULE_NAME)
    if loaded is not None:
        return loaded
    path = sdist / "tests" / "v1" / "kv_connector" / "unit" / "utils.py"
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module
