"""A whole instance in one process tree, for the shutdown tests (run as a script).

``python -m tests.integration.ranks._host RUNTIME_ROOT INSTANCE_ID MEMFD_NAME``
builds what the vLLM harness builds -- two rank processes (connected through
a short-lived private socket dir under the runtime root) attached to a memfd, an ``ElasticInstance``
with its control socket and the rank barrier, a few pages mapped on every
rank -- installs the instance's SIGINT/SIGTERM cleanup, prints one ``READY``
line (JSON) and waits for a signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout
from engine_ext import ElasticInstance, EngineBinding, EngineSettings
from engine_ext.ranks import RankChannelBarrier, RankedBackend, RankGroup


def main() -> int:
    root, instance_id, memfd_name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    layout = PageLayout(page_bytes=4096, num_pages=8, num_regions=2)
    owner = HostBackend.reserve(layout, name=memfd_name)
    group = RankGroup.spawn_private(root, instance_id, 2)
    backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=1024, slot_bytes=64)
    try:
        blocks = BlockAllocator(PageAllocator(backend), 4)
        instance = ElasticInstance(
            EngineSettings(runtime_dir=root, instance_id=instance_id),
            EngineBinding(engine="toy", engine_version="0", blocks=blocks),
        )
        instance.coordinator.set_rank_barrier(RankChannelBarrier(backend))
        instance.start()
        instance.install_signal_cleanup()
        held = blocks.alloc(10)  # three pages mapped on the owner and on both ranks
        assert held is not None
        instance.set_limit(1 << 20)  # a limit pass: the state lists both ranks
        assert instance.step().num_ranks == 2
        print(
            "READY "
            + json.dumps({"pid": os.getpid(), "ranks": group.pids, "socket": instance.socket_path}),
            flush=True,
        )
        while True:
            signal.pause()
    except KeyboardInterrupt:
        return 0
    finally:
        backend.release()


if __name__ == "__main__":
    sys.exit(main())
