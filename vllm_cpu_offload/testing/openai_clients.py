"""`openai` clients for load tests and benchmarks against a real `vllm serve`.

The client's connection pool keeps an idle connection for 5 s, and vLLM's HTTP server
closes an idle one after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request sent on a pooled
connection just as the server closes it reads a closed socket, a connection error that
depends on timing alone. These clients open a connection for every request and keep
none, so no request can meet a connection the server is closing.
"""

from __future__ import annotations

import httpx2
import openai

NO_KEEPALIVE = httpx2.Limits(max_connections=1000, max_keepalive_connections=0)


def client_per_request_connection(url: str, timeout_s: float) -> openai.AsyncOpenAI:
    """An async client for the server at `url` that never reuses a connection and
    never retries (a retry would send a request twice)."""
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="x",
        max_retries=0,
        timeout=timeout_s,
        http_client=openai.DefaultAsyncHttpx2Client(
            limits=NO_KEEPALIVE, timeout=timeout_s
        ),
    )
