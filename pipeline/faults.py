"""Named points where the fault-injection tests (tests/test_faults.py) SIGKILL a run."""
import os, signal
_hits: dict[str, int] = {}
def kill_point(name: str) -> None:
    """SIGKILL this process here when DRAFTSMITH_KILL_AT is `name` or `name@N` (the N-th time it is reached)."""
    want = os.environ.get("DRAFTSMITH_KILL_AT")
    if not want or want.split("@")[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(want.split("@")[1]) if "@" in want else True:
        os.kill(os.getpid(), signal.SIGKILL)
