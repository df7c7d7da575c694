"""worker.cpus: --inference-cpus parsing and planning (pure logic; the pinning itself is
tested on a real `heron serve` in tests/integration/test_inference_cpus.py)."""

from __future__ import annotations

import pytest

from heron.worker.cpus import CpuPlacement, format_cpu_list, parse_cpu_list, plan_placement


def test_cpu_lists_parse_and_format_like_linux_cpusets() -> None:
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list(" 2 ") == {2}
    assert format_cpu_list({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"
    for bad, why in (("0-x", "expected off, auto, or a CPU list"),
                     ("", "expected off, auto, or a CPU list"),
                     ("1,,2", "expected off, auto, or a CPU list"),
                     ("-1", "expected off, auto, or a CPU list"),
                     ("5-2", "the range 5-2 runs backwards")):
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad)


def test_off_leaves_placement_to_the_os() -> None:
    assert plan_placement("off", 1, {0, 1}) is None
    assert plan_placement("", 1, {0, 1}) is None
    assert plan_placement("OFF", 1, {0, 1}) is None


def test_auto_gives_the_model_its_threads_cpus_and_the_rest_the_others() -> None:
    assert plan_placement("auto", 1, {4, 5}) == CpuPlacement(frozenset({4}), frozenset({5}))
    assert plan_placement("auto", 3, {0, 1, 2, 3, 8}) == CpuPlacement(
        frozenset({0, 1, 2}), frozenset({3, 8}))


def test_auto_does_nothing_without_a_cpu_to_spare() -> None:
    assert plan_placement("auto", 2, {0, 1}) is None
    assert plan_placement("auto", 8, {0, 1}) is None


def test_an_explicit_list_takes_those_cpus_even_outside_the_current_mask() -> None:
    """A worker started on CPU 1 may still be told to compute on CPU 0 (the cpuset, not the
    starting mask, is the limit: checked when it is applied)."""
    assert plan_placement("0", 1, {1}) == CpuPlacement(frozenset({0}), frozenset({1}))
    # No CPU left for the rest: it keeps all the allowed ones.
    assert plan_placement("0-1", 2, {0, 1}) == CpuPlacement(frozenset({0, 1}),
                                                            frozenset({0, 1}))
    with pytest.raises(ValueError):
        plan_placement("zero", 1, {0, 1})
