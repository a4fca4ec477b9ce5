"""``pipelines.kfp_compat``: the kfp internals ``goodput run --local`` hooks, resolved on the installed kfp, and
what a kfp without them gets: nothing patched, and the reason said."""

from __future__ import annotations

import importlib.metadata

import pytest

from pipelines import kfp_compat


def test_every_internal_resolves_on_the_installed_kfp_which_is_a_checked_one():
    assert kfp_compat.check_internals() == [f"{m}.{p}" for m, p in kfp_compat.INTERNALS]
    assert kfp_compat.missing() is None
    assert importlib.metadata.version("kfp") in kfp_compat.CHECKED, "check kfp_compat's internals on this kfp"


def test_without_an_internal_nothing_is_patched_and_the_error_names_it_and_the_version(monkeypatch):
    from kfp.local.orchestrator.enhanced_dag_orchestrator import ConditionEvaluator

    monkeypatch.delattr(ConditionEvaluator, "_resolve_pipeline_channel")
    with pytest.raises(kfp_compat.KfpCompatError) as e:
        kfp_compat.check_internals()
    assert "checked on 2.17.3" in str(e.value) and "ConditionEvaluator._resolve_pipeline_channel:" in str(e.value)
    assert f"kfp {importlib.metadata.version('kfp')}" in kfp_compat.missing()
    with kfp_compat.named_outputs_in_conditions() as patched:
        assert not patched and "_resolve_pipeline_channel" not in ConditionEvaluator.__dict__


def test_the_task_hooks_are_in_place_only_while_the_block_runs():
    from kfp.local.orchestrator import task_executor

    before = (task_executor.task_dispatcher.run_single_task_implementation, task_executor.logging,
              task_executor.time)
    with kfp_compat.task_attempts(lambda attempt, args, kwargs: attempt(*args, **kwargs), print, print) as hooked:
        assert hooked and task_executor.time is not before[2]
    assert (task_executor.task_dispatcher.run_single_task_implementation, task_executor.logging,
            task_executor.time) == before
