"""Jupyter's own kernel conformance suite (``jupyter_kernel_test``, the checks kernel authors
run) against a sandboxed kernel: every message validated against the messaging spec, the
replies and outputs of execution, errors, completion, code completeness, the pager,
history, inspection, rich display and ``clear_output``, as a local IPython kernel gives
them. What runs differently in the sandbox (the relay, the host's bridge, the kernel's
start-up code, IPython's history kept in memory) must not show here."""

from __future__ import annotations

import unittest

import jupyter_kernel_test as jkt
import pytest

from .conftest import KernelStarter

pytestmark = pytest.mark.integration


class IPythonKernelTests(jkt.KernelTests):
    """jupyter_kernel_test's samples for IPython (its own ``test_ipykernel.py``); the kernel
    is the test's (see below), not one of setUpClass. History's "range" is left out as
    upstream leaves it out: IPython numbers the current session 0 in a range's reply, a
    local kernel as well."""

    __test__ = False  # run by the test below, on its kernel

    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls) -> None:
        """The kernel comes from the test (``start_kernel``: shut down and proven gone after)."""

    @classmethod
    def tearDownClass(cls) -> None:
        """(See setUpClass.)"""


CHECKS = sorted(name for name in dir(jkt.KernelTests) if name.startswith("test_"))


@pytest.mark.parametrize("check", CHECKS)
def test_a_sandboxed_kernel_passes_jupyters_kernel_conformance_suite(
    start_kernel: KernelStarter, check: str
) -> None:
    km, kc = start_kernel()
    case = IPythonKernelTests(check)
    case.km, case.kc = km, kc
    result = unittest.TestResult()
    case.run(result)
    problems = [f"{test}: {trace}" for test, trace in (*result.failures, *result.errors)]
    assert not problems, "\n".join(problems)
    skipped = {reason for _, reason in result.skipped} - {"History range not supported"}
    assert not skipped, f"{check} did not run all of itself: {skipped}"
