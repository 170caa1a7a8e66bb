"""The worker process of a model placed on llama.cpp rpc servers (flylocal.llama.remote): it
loads the model on its servers and decodes on request, its logits rows written into the shared
memory the client reads in place, until told to stop. ggml aborts this process, not the
client's, when a server goes away.

    python -m flylocal.llama.worker CONNECTION_FD SHARED_MEMORY_FD
"""

from __future__ import annotations

import dataclasses
import mmap
import sys
from multiprocessing.connection import Connection

import numpy as np

from flylocal.errors import FlylocalError
from flylocal.host import usable_cores
from flylocal.llama.runtime import Runtime


def _serve(conn: Connection, shm_fd: int) -> int:
    """The worker: load the model on its rpc servers and decode on request until told to stop."""
    path, config = conn.recv()
    try:
        # Every layer runs on the servers; the output layer here (--rpc-output here) gets the
        # threads asked for, or every core.
        threads = (config.n_threads or usable_cores()) if config.rpc_output == "here" else 1
        rt = Runtime(path, dataclasses.replace(config, n_threads=threads))
    except FlylocalError as e:
        conn.send(("error", str(e)))
        return 1
    conn.send(("ready", rt.n_ctx, rt.n_batch, [tuple(d.__dict__.values()) for d in rt.devices], rt.description()))
    cap, rows = 0, None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] != "decode":
            break
        _, keep, tokens, logits_from, want = message
        if want != cap:
            rows = np.frombuffer(mmap.mmap(shm_fd, want * rt.n_vocab * 4), dtype=np.float32).reshape(want, rt.n_vocab)
            cap = want
        try:
            rt.truncate(keep)
            logits = rt.decode(tokens, logits_from)
        except FlylocalError as e:
            conn.send(("error", str(e)))
            continue
        n = 0 if logits is None else len(logits)
        if n:
            rows[:n] = logits
        conn.send(("ok", n))
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(Connection(int(sys.argv[1])), int(sys.argv[2])))
