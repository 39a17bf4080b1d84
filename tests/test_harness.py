"""The test harness itself: two test runs on one machine never hand out the same port."""
import os
import subprocess
import sys

from conftest import next_port

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_second_test_process_takes_another_port_block():
    mine = next_port()
    # a process beside this one, as a second `make test` or another worker of this run would be
    other = subprocess.run([sys.executable, "-c", "import conftest; print(conftest.next_port())"], cwd=HERE,
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    theirs = int(other.stdout)
    assert mine // 1000 != theirs // 1000 and 21000 <= theirs < 32000, (mine, theirs)
