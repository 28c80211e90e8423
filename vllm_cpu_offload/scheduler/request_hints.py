"""What a client says of a request's KV: in its `kv_transfer_params`, and as
actions of its `KvHintsEnvelope`.

vLLM carries per-request connector parameters from the OpenAI API (the body's
`kv_transfer_params`, `extra_body` in the `openai` client) and from `LLM`
(`SamplingParams(extra_args={"kv_transfer_params": ...})`) to the connector. The host
tier reads:

    max_offload_tokens  int >= 0      store at most this many of the request's first
                                      tokens (0: none); as vLLM's own offloading
    retain              true | s > 0  the prefix will be read again (the next turn, the
                                      agent's next step): keep its blocks from
                                      eviction until then, or for s seconds
                                      (at most `max_retain_s`, however large s)
    done                true          the session ended: its blocks go first

vLLM 0.32 and 0.33 also carry an orchestrator's `KvHintsEnvelope` with each request
(`vllm/v1/kv_hints/protocol.py:20`, `Request.kv_hints` at `vllm/v1/request.py:198`,
given to `LLMEngine.add_request` / `AsyncLLM.generate` as `kv_hints`). Two of its
action types say the same as `retain` and `done`, named as the retention RFCs name
them (vLLM issues #51428 "Retain", #52113):

    action_type "retain", action_version "1", payload {} or {"ttl_s": s > 0}
    action_type "release", action_version "1", payload {}: the session ended

Both channels may speak of one request: the longer retain wins, either `done`
counts. Other action types belong to other components and are left alone.

A hint of the wrong type or range is ignored with one warning for the request, never
an error; a request without hints is served as if hints did not exist. Other keys
belong to other connectors and are left alone.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_cpu_offload.scheduler.tier_seams import NO_HINTS, RequestHints

logger = logging.getLogger(__name__)

# `retain: true`: how long the tier keeps the prefix for a client that names no time.
DEFAULT_RETAIN_S = 300.0


# The envelope's action types the host tier reads, and the one version of each.
RETAIN_ACTION = "retain"
RELEASE_ACTION = "release"
ACTION_VERSION = "1"


def hints_of(request: Any, *, max_retain_s: float) -> RequestHints:
    """The hints in `request.kv_transfer_params` and `request.kv_hints`; bad ones
    dropped with one warning naming them (`retain` is capped at `max_retain_s`)."""
    params = getattr(request, "kv_transfer_params", None)
    envelope = getattr(request, "kv_hints", None)
    if not (params and isinstance(params, dict)):
        params = None
    if params is None and envelope is None:
        return NO_HINTS
    bad: list[str] = []
    hints = NO_HINTS if params is None else _params_hints(params, max_retain_s, bad)
    if envelope is not None:
        hints = _with_envelope(hints, envelope, max_retain_s, bad)
    if bad:
        logger.warning(
            "request %s: ignoring CPU offload hint %s",
            getattr(request, "request_id", "?"),
            "; ".join(bad),
        )
    return hints


def _params_hints(
    params: dict[str, Any], max_retain_s: float, bad: list[str]
) -> RequestHints:
    """The hints of `kv_transfer_params`."""
    max_tokens = params.get("max_offload_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
        bad.append(f"max_offload_tokens={_shown(max_tokens)} (an int >= 0)")
        max_tokens = None
    retain_s = _retain_seconds(params.get("retain"), max_retain_s, bad)
    done = params.get("done", False)
    if done not in (True, False):
        bad.append(f"done={_shown(done)} (true or false)")
        done = False
    return RequestHints(max_tokens, retain_s, bool(done))


def _with_envelope(
    hints: RequestHints, envelope: Any, max_retain_s: float, bad: list[str]
) -> RequestHints:
    """`hints` with the retain and release actions of a `KvHintsEnvelope` added."""
    retain_s, done = hints.retain_s, hints.done
    for action in getattr(envelope, "actions", None) or ():
        kind = getattr(action, "action_type", None)
        if kind not in (RETAIN_ACTION, RELEASE_ACTION):
            continue  # another component's action
        version = getattr(action, "action_version", None)
        payload = getattr(action, "payload", None)
        if version != ACTION_VERSION or not isinstance(payload, dict):
            bad.append(
                f"kv_hints {kind} action_version={_shown(version)} payload of a "
                f"{type(payload).__name__} (version {ACTION_VERSION!r}, a dict)"
            )
        elif kind == RELEASE_ACTION:
            done = True
        else:
            ttl = payload.get("ttl_s", True)
            seconds = _retain_seconds(ttl, max_retain_s, bad)
            if seconds is not None and (retain_s is None or seconds > retain_s):
                retain_s = seconds
    return RequestHints(hints.max_offload_tokens, retain_s, done)


def _retain_seconds(value: Any, max_retain_s: float, bad: list[str]) -> float | None:
    """`retain` in seconds, at most `max_retain_s`."""
    if value is None or value is False:
        return None
    if value is True:
        return min(DEFAULT_RETAIN_S, max_retain_s)
    # Exact types: a bool is an int, and JSON gives no other subclass. NaN is not
    # > 0. An int is compared with the cap before it becomes a float, which one
    # past 1e308 cannot (OverflowError); an infinite float is capped like any other.
    if type(value) in (int, float) and value > 0:
        return float(min(value, max_retain_s))
    bad.append(f"retain={_shown(value)} (true, or seconds > 0)")
    return None


def _shown(value: Any) -> str:
    """`value` for the warning, cut short; never raises (the repr of an int past
    4,300 digits does)."""
    if isinstance(value, int) and value.bit_length() > 1024:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # a Python object's own repr, through `LLM`
        return f"<a {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
