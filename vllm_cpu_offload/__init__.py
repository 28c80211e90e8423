"""A second KV-cache tier in host memory for vLLM's v1 engine.

`import vllm_cpu_offload` applies the plugin at once where vLLM is installed. Scripts
need not import it: the installed `vllm_cpu_offload.pth` hook
(`vllm_cpu_offload_hook.py`) applies it when vLLM's `arg_utils` is first imported, since
vLLM itself loads plugins only after it has built its `EngineArgs`. Where vLLM is absent
(a GPU box that only benchmarks the kernels) nothing is imported: the worker-side
kernels and the transfer engine need torch and triton only.
"""

import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("vllm") is not None:
    from vllm_cpu_offload.plugin import register as _register

    _register()
