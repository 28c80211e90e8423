# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPUOffloadConnector: a second KV-cache tier in host memory.

`--enable-cpu-offload --swap-space GIB` (flags.py) resolves to this connector. The
scheduler role keeps a host block pool keyed by vLLM's block hashes (scheduler/); the
worker role copies blocks between the KV cache and one host allocation (worker/: torch
and triton only, no vLLM); connector.py only forwards between them.
"""
