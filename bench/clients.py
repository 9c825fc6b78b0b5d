"""Clients in threads of their own beside an engine whose loop runs on the calling thread.

The engine steps on the thread that loaded the models, as the server's does (dspark.serve.process):
on the CPU a second thread computing would get an OpenMP team of its own, and both teams' threads
together outnumber the cores, which makes libgomp stop spinning between parallel regions and every
small GEMM wait for its workers to wake (29% of a step on two cores).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from dspark.engine import Engine

IDLE_S = 1e-4  # the loop's sleep while no request is running or waiting


@torch.inference_mode()
def serve_clients(engine: Engine, clients: list[Callable[[], None]]) -> None:
    """Runs each client in a thread and the engine's loop on this thread until every client has returned."""
    threads = [threading.Thread(target=client, daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        if engine.num_running() or engine.num_waiting():
            engine.step()
        else:
            time.sleep(IDLE_S)
