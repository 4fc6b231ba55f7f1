"""KeyedExecutor under CPython's own executor tests (test.test_concurrent_futures), through
their mixin pattern: a KeyedExecutorMixin beside their ProcessPoolForkMixin and friends,
combined with ExecutorTest, ProcessPoolExecutorTest, WaitTests, AsCompletedTests,
ExecutorShutdownTest, ProcessPoolShutdownTest and ExecutorDeadlockTest, under the fork,
spawn and forkserver start methods. The tests are loaded where the interpreter's test
suite is installed (see cpython_futures_suite.py; CI installs Debian's
libpython3.X-testsuite when it is missing).

CANNOT_PASS lists every test that cannot pass, with the reason; every other one must."""

from __future__ import annotations

import multiprocessing
import unittest
from typing import Any

import cpython_futures_suite as suite
import pytest

import shmchan

if suite.FOUND is None:
    print(f"test_executor_cpython: skipped: {suite.WHY}")
    pytest.skip(suite.WHY, allow_module_level=True)

_BY_DESIGN = (
    "a worker's death does not break a KeyedExecutor, by design: the worker is replaced "
    "and its task runs again (up to max_attempts, then WorkerDied), so no "
    "BrokenProcessPool"
)
_SCRIPT = (
    "its script imports the executor class by name from concurrent.futures (and the "
    "suite's helpers from the test package) in a fresh isolated interpreter; "
    "test_executor.py checks the same interpreter-exit behaviour for KeyedExecutor"
)
_INTERNALS = (
    "it inspects ProcessPoolExecutor's private attributes (_processes, _mp_context, "
    "_executor_manager_thread)"
)
_AT_SUBMIT = (
    "what cannot be pickled fails at submit, in the caller (TaskNotPicklable, a "
    "PicklingError), by design, not later from result()"
)
_OWN_ERROR = (
    "a task whose call or result cannot be unpickled fails with that error (its own "
    "future only: the executor is not broken, by design), not BrokenProcessPool"
)

# test name (as in CPython's class) -> why it cannot pass with a KeyedExecutor
CANNOT_PASS: dict[str, str] = {
    "test_killed_child": _BY_DESIGN,
    "test_crash_during_func_exec_on_worker": _BY_DESIGN,
    "test_exit_during_func_exec_on_worker": _BY_DESIGN,
    "test_crash_at_task_unpickle": _BY_DESIGN,
    "test_crash_during_result_pickle_on_worker": _BY_DESIGN,
    "test_exit_during_result_pickle_on_worker": _BY_DESIGN,
    "test_shutdown_deadlock": _BY_DESIGN,
    "test_interpreter_shutdown": _SCRIPT,
    "test_submit_after_interpreter_shutdown": _SCRIPT,
    "test_hang_gh83386": _SCRIPT,
    "test_error_at_task_pickle": _AT_SUBMIT,
    "test_shutdown_deadlock_pickle": _AT_SUBMIT,
    "test_exit_at_task_unpickle": _OWN_ERROR,
    "test_error_at_task_unpickle": _OWN_ERROR,
    "test_error_during_result_unpickle_in_result_handler": _OWN_ERROR,
    "test_exit_during_result_unpickle_in_result_handler": _OWN_ERROR,
    "test_traceback": (
        "the worker's traceback is the exception's __cause__ as shmchan.RemoteTraceback "
        "(same .tb text), not the private concurrent.futures.process._RemoteTraceback"
    ),
    "test_processes_terminate": (
        "its task is a function local to the test, which cannot be pickled (a "
        "KeyedExecutor pickles every task at submit), and it reads _processes"
    ),
    "test_saturation": _INTERNALS,
    "test_idle_process_reuse_one": _INTERNALS,
    "test_idle_process_reuse_multiple": _INTERNALS,
    "test_max_tasks_per_child": _INTERNALS,
    "test_max_tasks_per_child_defaults_to_spawn_context": _INTERNALS,
    "test_cancel_futures": (
        "it asserts that at least one of 50 tasks submitted just before "
        "shutdown(cancel_futures=True) ran (a ProcessPoolExecutor's queued calls cannot be "
        "cancelled); a KeyedExecutor cancels every task no worker has started, by design, "
        "so a shutdown that comes before a worker started one cancels all 50: it passes or "
        "fails by timing (test_executor_contract.py checks the rule itself)"
    ),
}


class KeyedExecutorMixin(suite.ExecutorMixin):  # type: ignore[misc]
    executor_type = shmchan.KeyedExecutor
    worker_count = 2  # (CPython uses 5; two keep the spawn runs short on a small machine)
    ctx = "fork"

    def get_context(self) -> Any:
        return multiprocessing.get_context(self.ctx)


_GROUPS = (
    suite.ExecutorTest,
    suite.ProcessPoolExecutorTest,
    suite.WaitTests,
    suite.AsCompletedTests,
    suite.ExecutorShutdownTest,
    suite.ProcessPoolShutdownTest,
    suite.ExecutorDeadlockTest,
)


def _make(group: type, method: str) -> type:
    mixin = type(f"KeyedExecutor{method.title()}Mixin", (KeyedExecutorMixin,), {"ctx": method})
    attrs: dict[str, Any] = {}
    for name in dir(group):
        if name in CANNOT_PASS and name.startswith("test_"):
            attrs[name] = unittest.skip(f"cannot pass: {CANNOT_PASS[name]}")(getattr(group, name))
    name = f"KeyedExecutor{method.title()}{group.__name__}"
    return type(name, (group, mixin, suite.BaseTestCase), attrs)


for _method in ("fork", "spawn", "forkserver"):
    for _group in _GROUPS:
        _cls = _make(_group, _method)
        globals()[_cls.__name__] = _cls
del _cls, _group, _method
