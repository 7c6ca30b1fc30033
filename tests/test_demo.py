import subprocess
import sys


def test_demo_runs_headless_to_completion() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_pdrouter.demo", "--seconds", "3", "--concurrency", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("summary: ")
    done = int(summary.split()[1])
    assert done > 0
    assert " 0 failed" in summary
