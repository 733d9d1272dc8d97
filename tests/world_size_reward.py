"""A reward function for runs that `dppo-trl` launches in other processes (named in a YAML as
``tests.world_size_reward.recording_reward``): it writes what each process's trainer sees of the process
group (rank, world size, backend) to ``$DPPO_TEST_WORLD_DIR/rank<RANK>.json``, so that a test can tell how many
processes trained; and, once per process, registers an ``atexit`` handler that writes ``atexit<RANK>`` there and
starts a non-daemon thread that writes ``thread<RANK>`` once the main thread has finished, so that a test can
tell that each process ran its exit handlers and joined its threads at exit. It lives outside the test files so
that the launched processes can import it cheaply."""

import atexit
import functools
import json
import os
import threading
from pathlib import Path


@functools.cache
def _register_exit_markers(out: Path, rank: str) -> None:
    """Once per process: at exit, write ``atexit<RANK>`` (what a tracker's final sync, e.g. ``wandb.finish``, does
    at exit); a non-daemon thread writes ``thread<RANK>`` after the main thread has finished (what Python's exit
    waits for before the exit handlers)."""
    atexit.register((out / f"atexit{rank}").write_text, "ran")

    def after_main_thread():
        threading.main_thread().join()
        (out / f"thread{rank}").write_text("ran")

    threading.Thread(target=after_main_thread, daemon=False).start()


def recording_reward(completions, **kwargs):
    """A reward with spread (as ``support.rewards.random_reward``); on every call it rewrites this process's
    ``rank<RANK>.json`` with ``{"rank", "world_size", "backend"}`` (world size 1, backend None without a
    process group)."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    record = {
        "rank": dist.get_rank() if grouped else 0,
        "world_size": dist.get_world_size() if grouped else 1,
        "backend": dist.get_backend() if grouped else None,
    }
    out, rank = Path(os.environ["DPPO_TEST_WORLD_DIR"]), os.environ.get("RANK", "0")
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    _register_exit_markers(out, rank)
    return [float((sum(map(ord, c)) * 7919) % 5) for c in completions]
