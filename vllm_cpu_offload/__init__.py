"""A second KV-cache tier in host memory for vLLM's v1 engine.

Importing this package does not import vLLM: the worker-side kernels and the
transfer engine must load on machines that have only torch and triton.
"""

__version__ = "0.1.0"
