"""Suite-wide set-up: the environment the tests see, and a watchdog on every test.

The tests configure OpenTelemetry themselves: a variable such as OTEL_TRACES_SAMPLER or
OTEL_EXPORTER_OTLP_ENDPOINT in the runner's environment would otherwise change what the traced
app records, and reach the servers the tests start as subprocesses. Tests that read these
variables set them with monkeypatch.

pytest-timeout fails a test that runs too long, but when a test fails, pytest-timeout and
pytest's faulthandler both stop their timers (pytest_exception_interact), so a teardown that
then hangs (an engine that never shuts down) would hang the run without a word. The watchdog
here covers a test's setup, call and teardown, failed or not: past WATCHDOG_S it prints every
thread's stack and ends the process.
"""

import faulthandler
import os
import sys

import pytest

for _name in [name for name in os.environ if name.startswith("OTEL_")]:
    del os.environ[_name]

WATCHDOG_S = 600.0
_stderr_fd: int | None = None


def pytest_configure(config):
    global _stderr_fd
    _stderr_fd = os.dup(sys.stderr.fileno())  # stays the terminal while tests' output is captured


def pytest_unconfigure(config):
    global _stderr_fd
    faulthandler.cancel_dump_traceback_later()
    if _stderr_fd is not None:
        os.close(_stderr_fd)
        _stderr_fd = None


def _arm_watchdog() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=_stderr_fd)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    _arm_watchdog()
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node, call, report):
    """Runs after the plugins that stop their timers here: the teardown still has a limit."""
    if _stderr_fd is not None and isinstance(node, pytest.Item):
        _arm_watchdog()
