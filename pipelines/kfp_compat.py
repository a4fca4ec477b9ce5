"""Every internal of kfp that goodput touches: two hooks into ``kfp.local`` for ``goodput run --local``.

``trainer/compat.py`` holds the private torch and NVRx APIs; this module holds kfp's, because the trainer never
imports kfp. Checked on kfp 2.17.3 (``CHECKED``). ``kfp.local``'s public API is ``init`` and its runners, with no
option for either of these:

- ``task_attempts``: a hook around each attempt of a task, its retry messages and its sleeps between attempts
  (``kfp.local.orchestrator.task_executor``: its dispatcher, its ``logging`` and ``time`` modules);
- ``named_outputs_in_conditions``: a ``dsl.If`` on a NamedTuple output resolved as the KFP backend resolves it
  (``ConditionEvaluator._resolve_pipeline_channel``).

Each is in place only while the block runs. Under a kfp without the internals, nothing is patched and the
block is told so: the run is then what kfp.local makes of it (retries without a word; a condition on a named
output that resolves to nothing). ``check_internals`` resolves them all; a test runs it on the installed kfp.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from trainer import compat

CHECKED = ("2.17.3",)

_EXECUTOR = "kfp.local.orchestrator.task_executor"
_CONDITIONS = "kfp.local.orchestrator.enhanced_dag_orchestrator"
INTERNALS: tuple[tuple[str, str], ...] = (
    (_EXECUTOR, "task_dispatcher.run_single_task_implementation"),
    (_EXECUTOR, "logging"),
    (_EXECUTOR, "time"),
    ("kfp.local.status", "Status.SUCCESS"),
    (_CONDITIONS, "ConditionEvaluator._resolve_pipeline_channel"),
)

# What the task executor logs before it sleeps and attempts a task again.
_RETRYING = re.compile(r"Task (?P<task>\S+) failed \(attempt (?P<k>\d+)/(?P<n>\d+)\)\. Retrying in (?P<delay>[\d.]+)s")


class KfpCompatError(RuntimeError):
    """An internal of kfp this module uses is missing from the installed kfp."""


@dataclass(frozen=True)
class Retry:
    """kfp.local is about to attempt ``task`` again: attempt ``attempt`` of ``attempts``, after ``delay_s``."""

    task: str
    attempt: int
    attempts: int
    delay_s: float


@contextlib.contextmanager
def task_attempts(around: Callable[[Callable, tuple, dict], tuple], on_retry: Callable[[Retry], None],
                  sleep: Callable[[float], None]) -> Iterator[bool]:
    """While the block runs, kfp.local runs each attempt of a task as ``around(attempt, args, kwargs)`` (which
    calls ``attempt(*args, **kwargs)`` for its ``(outputs, state)``, or raises), calls ``on_retry`` before it
    attempts a task again, and waits between attempts with ``sleep``. Yields whether the hooks are in place."""
    try:
        executor = importlib.import_module(_EXECUTOR)
        dispatch = executor.task_dispatcher.run_single_task_implementation
        saved = executor.logging, executor.time
    except (ImportError, AttributeError):
        yield False
        return

    class Logging:
        def __getattr__(self, name):
            return getattr(saved[0], name)

        def info(self, msg, *args, **kwargs):
            m = _RETRYING.match(str(msg))
            if m:
                on_retry(Retry(m["task"], int(m["k"]) + 1, int(m["n"]), float(m["delay"])))
            return saved[0].info(msg, *args, **kwargs)

    class Time:
        def __getattr__(self, name):
            return getattr(saved[1], name)

        def sleep(self, seconds: float) -> None:
            sleep(seconds)

    executor.task_dispatcher.run_single_task_implementation = lambda *a, **kw: around(dispatch, a, kw)
    executor.logging, executor.time = Logging(), Time()
    try:
        yield True
    finally:
        executor.task_dispatcher.run_single_task_implementation = dispatch
        executor.logging, executor.time = saved


def succeeded(state) -> bool:
    """Whether a task attempt's ``state`` (what ``around``'s ``attempt`` returns second) is a success."""
    from kfp.local import status

    return state == status.Status.SUCCESS


@contextlib.contextmanager
def named_outputs_in_conditions() -> Iterator[bool]:
    """Let kfp.local evaluate ``dsl.If(task.outputs["name"] == ...)`` on a NamedTuple output.

    kfp.local 2.17 resolves a condition's channel ``pipelinechannel--<task>-<output>`` by guessing:
    ``<task>-Output`` (a single return value) or a parent input. A NamedTuple output such as
    ``evaluate-op-promoted`` is neither, so the condition resolves to nothing and its branch is skipped. The KFP
    backend resolves it properly; here the channel is first tried as (task, output) split at each '-' from the
    right, then as kfp.local would. Yields whether the patch is in place.
    """
    try:
        evaluator = importlib.import_module(_CONDITIONS).ConditionEvaluator
        original = evaluator.__dict__["_resolve_pipeline_channel"]
    except (ImportError, AttributeError, KeyError):
        yield False
        return

    def resolve(channel_ref, io_store):
        ref = channel_ref.replace("pipelinechannel--", "")
        cut = len(ref)
        while (cut := ref.rfind("-", 0, cut)) > 0:
            with contextlib.suppress(ValueError):    # not this split: the io store has no such output
                return io_store.get_task_output(ref[:cut], ref[cut + 1:])
        return original.__func__(channel_ref, io_store)

    evaluator._resolve_pipeline_channel = staticmethod(resolve)
    try:
        yield True
    finally:
        evaluator._resolve_pipeline_channel = original


def missing() -> str | None:
    """What ``check_internals`` finds broken, as one line; None when every internal resolves."""
    try:
        check_internals()
    except KfpCompatError as e:
        return " ".join(str(e).split())
    return None


def check_internals() -> list[str]:
    """Resolve every entry of ``INTERNALS`` on the installed kfp; raise one error listing all that broke."""
    resolved, broken = compat.resolve_internals(INTERNALS)
    if broken:
        raise KfpCompatError(f"kfp internals goodput uses are gone (kfp {importlib.metadata.version('kfp')}; checked "
                             f"on {', '.join(CHECKED)}); pipelines/kfp_compat.py must be updated:\n  "
                             + "\n  ".join(broken))
    return resolved
