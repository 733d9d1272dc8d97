"""A reward function for runs that `dppo-trl` launches in other processes (named in a YAML as
``tests.world_size_reward.recording_reward``): it writes what each process's trainer sees of the process
group (rank, world size, backend) to ``$DPPO_TEST_WORLD_DIR/rank<RANK>.json``, so that a test can tell how many
processes trained. It lives outside the test files so that the launched processes can import it cheaply."""

import json
import os
from pathlib import Path


def recording_reward(completions, **kwargs):
    """A reward with spread (as conftest's ``random_reward``); on every call it rewrites this process's
    ``rank<RANK>.json`` with ``{"rank", "world_size", "backend"}`` (world size 1, backend None without a
    process group)."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    record = {
        "rank": dist.get_rank() if grouped else 0,
        "world_size": dist.get_world_size() if grouped else 1,
        "backend": dist.get_backend() if grouped else None,
    }
    out = Path(os.environ["DPPO_TEST_WORLD_DIR"])
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    return [float((sum(map(ord, c)) * 7919) % 5) for c in completions]
