"""FiniteGuard under torch.distributed: 2 gloo processes on CPU must skip the same steps.

Run as a script: ``python dist_guard.py``; exits 0 when both ranks agree, prints one line per
rank. Rank 1 alone sees a NaN gradient in step 0; both ranks must skip it and step at step 1.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from stablelosses.debug import FiniteGuard

        w = torch.nn.Parameter(torch.ones(3))
        guard = FiniteGuard(torch.optim.SGD([w], lr=0.5))
        results = []
        for step in range(2):
            scale = float("nan") if (step == 0 and rank == 1) else 1.0
            (w * scale).sum().backward()
            results.append(guard.step())
        queue.put((rank, results, w.detach().tolist(), guard.total_skips))
    finally:
        dist.destroy_process_group()


def main() -> int:
    world = 2
    # fork where there is one: this parent has run no torch op yet, and it saves two
    # interpreter starts (importing torch); spawn elsewhere
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    ctx = mp.get_context(method)
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), queue), nprocs=world, join=True,
                       start_method=method)
    out = sorted(queue.get() for _ in range(world))
    for rank, results, w, skips in out:
        print(f"rank {rank}: stepped={results} w={w} skips={skips}")
    ok = all(r[1] == [False, True] and r[2] == [0.5, 0.5, 0.5] and r[3] == 1 for r in out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
