"""benchmarks/stack_probe: a process started with the probe on PYTHONPATH writes its stacks while the trigger exists,
nothing without it, and timeline() reads one thread's frames back."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "stack_probe"))

import timeline  # noqa: E402

CHILD = "import time\ndef waiting_here():\n    time.sleep(0.6)\nwaiting_here()\n"


def _run(tmp_path: Path, trigger: Path) -> list[Path]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks" / "stack_probe"), PROBE_TRIGGER=str(trigger),
               PROBE_DIR=str(tmp_path), PROBE_EVERY_S="0.05")
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    return sorted(tmp_path.glob("stacks-*.txt"))


def test_the_probe_samples_while_triggered(tmp_path):
    trigger = tmp_path / "on"
    trigger.write_text("")
    (stacks,) = _run(tmp_path, trigger)
    rows = timeline.timeline(stacks.read_text(), "MainThread", frames=2)
    assert len(rows) >= 3 and rows[0][0] == 0 and rows[-1][0] > rows[0][0]
    assert all(frames == ["<string>:3:waiting_here", "<string>:4:<module>"] for _, frames in rows)  # innermost first


def test_the_probe_writes_nothing_untriggered(tmp_path):
    assert _run(tmp_path, tmp_path / "absent") == []
