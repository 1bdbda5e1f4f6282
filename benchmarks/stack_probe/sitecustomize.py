"""Stack probe for a server on a device machine: put this folder first on PYTHONPATH with PROBE_TRIGGER (a path) and
PROBE_DIR (a folder) set, and every Python process started with that environment (SGLang's scheduler, tokenizer and
detokenizer, the kvstore daemon) appends its threads' stacks to PROBE_DIR/stacks-PID.txt every PROBE_EVERY_S seconds
(default 0.25) while the file PROBE_TRIGGER exists. benchmarks/stack_probe/timeline.py prints one thread's timeline.

Why not SGLang's profiler: it records CUDA work and torch ops, and its Python stacks slow the host; this costs nothing
until triggered and shows where the scheduler waits (a JIT build, a device sync). Why not signals: faulthandler's
SIGUSR1 dump never reached the scheduler process (session 40). It shadows the system's sitecustomize (Debian's only
adds apport hooks): do not use it outside such a run."""

import os
import sys
import threading
import time
import traceback

_TRIGGER, _DIR = os.environ.get("PROBE_TRIGGER"), os.environ.get("PROBE_DIR")
_EVERY_S = float(os.environ.get("PROBE_EVERY_S", "0.25"))


def _sample() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    out = [f"=== {time.time():.3f} pid {os.getpid()} {comm}"]
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            out.append(f"--- thread {names.get(ident, ident)}")
            out.extend(line.rstrip() for line in traceback.format_stack(frame)[-25:])
    return "\n".join(out) + "\n"


def _loop() -> None:
    while True:
        time.sleep(_EVERY_S)
        if os.path.exists(_TRIGGER):
            with open(os.path.join(_DIR, f"stacks-{os.getpid()}.txt"), "a") as f:
                f.write(_sample())


if _TRIGGER and _DIR:
    threading.Thread(target=_loop, daemon=True, name="stack-probe").start()
