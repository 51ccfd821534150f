"""One description of how a child process ended, shared by the distributed
workers' and the serving replicas' errors."""

import signal
import subprocess
import sys

import pytest

from kvforge.engine.process_exit import describe_exit


@pytest.mark.parametrize("exitcode, expected", [
    (-9, "(pid 42) was killed by signal 9 (SIGKILL)"),
    (-15, "(pid 42) was killed by signal 15 (SIGTERM)"),
    (1, "(pid 42) exited with code 1"),
    (0, "(pid 42) exited with code 0"),
    (None, "(pid 42) stopped answering but is still running"),
])
def test_names_the_signal_by_number_and_name_or_the_exit_code(exitcode, expected):
    assert describe_exit(42, exitcode) == expected


def test_an_unnamed_signal_is_given_by_its_number():
    unnamed = next(n for n in range(signal.SIGRTMIN, signal.SIGRTMAX) if n not in set(signal.Signals))
    assert describe_exit(None, -unnamed) == f"was killed by signal {unnamed}"


def test_reads_a_real_process_end_as_the_process_module_reports_it():
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(30)
    assert describe_exit(killed.pid, killed.returncode) == f"(pid {killed.pid}) was killed by signal 9 (SIGKILL)"


def test_the_distributed_and_serving_errors_use_it_and_no_copy_remains():
    pytest.importorskip("prometheus_client")  # the serve extra
    from kvforge.distributed import executor
    from kvforge.serving import data_parallel_loop, replica_pool

    assert executor.describe_exit is describe_exit
    assert replica_pool.describe_exit is describe_exit and data_parallel_loop.describe_exit is describe_exit
    assert not hasattr(executor, "exit_reason") and not hasattr(replica_pool, "exit_description")
