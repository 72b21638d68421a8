"""A NaN created in a worker thread (for `stablelosses trace`): ``pool`` uses a thread pool,
``sub`` a Thread subclass, ``clean`` a worker that computes nothing non-finite."""

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch


def work(x):
    return torch.log(x - 1.0)  # WORKER: log of a negative number


class Worker(threading.Thread):
    def run(self):
        work(torch.zeros(3))


if __name__ == "__main__":
    how = sys.argv[1]
    if how == "pool":
        with ThreadPoolExecutor(1, thread_name_prefix="loader") as pool:
            pool.submit(work, torch.zeros(3)).result()
    elif how == "sub":
        t = Worker(name="feeder")
        t.start()
        t.join()
    else:
        t = threading.Thread(target=work, args=(torch.full((3,), 2.0),), name="clean")
        t.start()
        t.join()
    print("done")
