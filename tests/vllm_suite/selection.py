"""Which of vLLM 0.32.0's tests the suite runs, and what it leaves out, with the reason.

CI runs `FILES`: vLLM's scheduler, KV cache manager and prefix-caching tests
(tests/v1/core) and its connector-generic tests (tests/v1/kv_connector/unit: config,
lifecycle, invalid blocks, load-failure recovery, multi-connector, and vLLM's own
offloading connector, the closest relative of ours). `ALL_FILES` (`run.py --all`) adds
the tests of third-party connectors and of tests/v1/kv_offload and
tests/v1/simple_kv_offload.

Left out: tests that cannot run on this machine without the plugin either. They need a
CUDA device, torchvision (multimodal models), ray, pytest-asyncio, or real weights from
the hub; which is which was measured with `run.py --mode plain --all`.
"""

from __future__ import annotations

CORE = "tests/v1/core"
UNIT = "tests/v1/kv_connector/unit"

FILES: tuple[str, ...] = (
    f"{CORE}/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
    f"{CORE}/prefix_cache/test_partial_prefix_cache_hits.py",
    f"{CORE}/prefix_cache/test_partial_prefix_cache_primitives.py",
    f"{CORE}/test_async_scheduler.py",
    f"{CORE}/test_contiguous_kv_packing.py",
    f"{CORE}/test_deferred_block_free.py",
    f"{CORE}/test_encoder_cache_manager.py",
    f"{CORE}/test_kv_cache_metrics.py",
    f"{CORE}/test_kv_cache_utils.py",
    f"{CORE}/test_kv_sharing.py",
    f"{CORE}/test_mamba_align_chunk_split.py",
    f"{CORE}/test_output.py",
    f"{CORE}/test_prefix_caching.py",
    f"{CORE}/test_prefix_replay.py",
    f"{CORE}/test_priority_preemption_bug.py",
    f"{CORE}/test_repetition_detection.py",
    f"{CORE}/test_scheduler.py",
    f"{CORE}/test_single_type_kv_cache_manager.py",
    f"{CORE}/test_swa_inflight_window_free.py",
    f"{CORE}/test_worker_slot_overflow.py",
    f"{UNIT}/offloading_connector",
    f"{UNIT}/test_cache_pollution_prevention.py",
    f"{UNIT}/test_config.py",
    f"{UNIT}/test_decode_bench_connector.py",
    f"{UNIT}/test_error_propagation.py",
    f"{UNIT}/test_handshake_pp_aggregation.py",
    f"{UNIT}/test_hma_auto_config.py",
    f"{UNIT}/test_invalid_blocks_correctness.py",
    f"{UNIT}/test_kv_connector_lifecycle.py",
    f"{UNIT}/test_kv_load_failure_recovery.py",
    f"{UNIT}/test_multi_connector.py",
    f"{UNIT}/test_output_aggregator.py",
    f"{UNIT}/test_remote_decode_lifecycle.py",
    f"{UNIT}/test_remote_prefill_lifecycle.py",
    f"{UNIT}/test_simple_cpu_offload_connector.py",
    f"{UNIT}/test_simple_cpu_offload_metrics.py",
    f"{UNIT}/test_tp_mapping.py",
    f"{UNIT}/test_transfer_topology_sharded.py",
)

ALL_FILES: tuple[str, ...] = (
    CORE,
    UNIT,
    "tests/v1/kv_offload",
    "tests/v1/simple_kv_offload",
)

# Whole files of CORE and UNIT that FILES leaves out, and why (measured
# without the plugin).
LEFT_OUT_FILES: dict[str, str] = {
    f"{CORE}/prefix_cache/test_hybrid_prefix_cache_hit_rate.py": (
        "weights of Qwen/Qwen3.5-0.8B"
    ),
    f"{CORE}/test_priority_scheduler_random.py": (
        "Qwen/Qwen2.5-VL-3B-Instruct (torchvision)"
    ),
    f"{CORE}/test_reset_prefix_cache_e2e.py": "an engine with real weights",
    f"{CORE}/test_scheduler_e2e.py": "weights of hmellor/tiny-random-LlamaForCausalLM",
    f"{UNIT}/test_offloading_connector.py": (
        "CUDA, and weights of meta-llama/Llama-3.2-1B"
    ),
    f"{UNIT}/test_scheduler_kv_connector_override.py": "fails without the plugin here "
    '("Unsupported connector type: DummyKVConnector")',
    f"{UNIT}/test_example_connector.py": "CUDA",
}

# Tests of tests/v1/core/test_scheduler.py that build llava-hf/llava-1.5-7b-hf, whose
# processor needs torchvision.
_SCHEDULER_MULTIMODAL = (
    "test_schedule_multimodal_requests",
    "test_schedule_partial_requests",
    "test_encoder_only_prompt_longer_than_budget_is_chunked",
    "test_same_step_duplicate_encoder_input_stays_cached",
    "test_no_mm_input_chunking[False]",
    "test_no_mm_input_chunking[True]",
    "test_no_mm_input_chunking_for_same_step_duplicate",
    "test_ec_connector_text_only_request[False]",
    "test_ec_connector_text_only_request[True]",
    "test_ec_connector_cache_hit_external_load[False]",
    "test_ec_connector_cache_hit_external_load[True]",
    "test_ec_connector_cache_miss_computes_locally[False]",
    "test_ec_connector_cache_miss_computes_locally[True]",
    "test_ec_connector_with_partial_cache_hit_multi_round[False]",
    "test_ec_connector_with_partial_cache_hit_multi_round[True]",
    "test_ec_connector_schedule_multiple_requests[False-local]",
    "test_ec_connector_schedule_multiple_requests[False-connector_only]",
    "test_ec_connector_schedule_multiple_requests[False-no_where]",
    "test_ec_connector_schedule_multiple_requests[True-local]",
    "test_ec_connector_schedule_multiple_requests[True-connector_only]",
    "test_ec_connector_schedule_multiple_requests[True-no_where]",
    "test_ec_connector_unable_to_allocate[False]",
    "test_ec_connector_unable_to_allocate[True]",
    "test_priority_scheduling_ec_connector_preemption_and_resumption[False-local]",
    "test_priority_scheduling_ec_connector_preemption_and_resumption[False-connector_only]",
    "test_priority_scheduling_ec_connector_preemption_and_resumption[False-no_where]",
    "test_priority_scheduling_ec_connector_preemption_and_resumption[True-local]",
    "test_priority_scheduling_ec_connector_preemption_and_resumption[True-connector_only]",
    "test_priority_scheduling_ec_connector_preemption_and_resumption[True-no_where]",
    "test_ec_connector_allocate_encoder_tokens_with_external_load[False]",
    "test_ec_connector_allocate_encoder_tokens_with_external_load[True]",
    "test_ec_connector_update_connector_output_called",
    "test_eagle3_mm_encoder_cache_with_shift",
    "test_free_encoder_inputs_respects_unconfirmed_placeholders",
    "test_free_encoder_inputs_notifies_the_ec_connector",
    "test_unavailable_encoder_input_fails_the_request_as_retryable",
    "test_encoder_cache_accepts_matching_embed_count",
    "test_encoder_cache_rejects_mismatched_embed_count",
    "test_encoder_cache_embed_count_mismatch_restores_prior_hit_state",
    "test_encoder_cache_rejects_mismatched_embed_count_within_request",
    "test_free_encoder_inputs_defers_for_eagle_lookahead",
    "test_free_encoder_inputs_unchanged_without_spec_decode",
    "test_encoder_cache_retained_across_preemption_and_resume",
    "test_encoder_cache_recomputed_when_evicted_during_preemption",
    "test_ec_connector_ensure_cache_available_defers_request[False]",
    "test_ec_connector_ensure_cache_available_defers_request[True]",
    "test_ec_connector_defers_running_request_for_async_reload",
)

DESELECTED: dict[str, str] = {
    f"{UNIT}/test_multi_connector.py::test_multi_example_connector_consistency": (
        "weights of meta-llama/Llama-3.2-1B-Instruct"
    ),
    **{
        f"{CORE}/test_scheduler.py::{name}": "llava-1.5-7b-hf: torchvision"
        for name in _SCHEDULER_MULTIMODAL
    },
}
