"""Where fsdp() puts thunder_overlap's executors in a list that holds a fuser of collectives
([Note: fusing executors]); what they do to traces is tested in test_trace_order_fake_group.py."""

from __future__ import annotations

from thunder_overlap import _ops as ops


def test_matmuls_and_epilogues_go_just_before_a_fuser_that_could_swallow_collectives():
    from thunder.executors.sdpaex import sdpa_ex
    from thunder.executors.torch_compile import torch_compile_cat_ex, torch_compile_ex
    from thunder.executors.torchex import ex as torch_ex

    ours = [ops.overlap_executor, ops.unfused_matmuls, ops.gathered_epilogues_unfused]
    expected = [ours[0], sdpa_ex, *ours[1:], torch_compile_ex, torch_ex]
    assert ops.with_collectives_kept_visible([sdpa_ex, torch_compile_ex, torch_ex]) == expected
    assert ops.with_collectives_kept_visible([*ours, torch_compile_ex]) == [*ours, torch_compile_ex]
    # No fuser of collectives (torchcompile_cat takes cat and elementwise ops only): unchanged.
    assert ops.with_collectives_kept_visible([sdpa_ex, torch_compile_cat_ex, torch_ex]) == [sdpa_ex, torch_compile_cat_ex, torch_ex]
