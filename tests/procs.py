"""Process checks the live tests share."""


def alive(pid: int) -> bool:
    """A live process: not gone, and not a zombie its parent has not reaped yet. (One open of
    /proc/PID/stat, not `exists(/proc/PID)` then open: the parent may reap it between the two.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_groups(procs) -> None:
    """Stop the process groups of `procs` (Popen objects started with `start_new_session=True`: a worker and the
    stage processes it started): SIGTERM, then SIGKILL after 20 s (`qosflow.procgroup.stop_group`)."""
    from qosflow.procgroup import stop_group

    for p in procs:
        stop_group(p, 20.0)


def marks(path) -> list[dict]:
    """The JSON lines a test's stages appended to their marker file (one dict a line); [] before the first."""
    import json
    from pathlib import Path

    path = Path(path)
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond()` every 0.1 s until it is true; fail the test with `what` after `timeout` seconds."""
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not reached"
        time.sleep(0.1)
