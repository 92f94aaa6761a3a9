"""The proposer process and its worker never wait on each other's reading: hundreds of studies reaching their first
sampled trial at once (a tune's round after the seeds) fill the pipe with proposals one way and requests the other.
Here the pipe's buffers are made tiny, so that a few dozen studies fill them."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import optuna

from normtune.kernels.config import Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.space import Space
from normtune.tuner.sweep import proposer as P

STUDIES = 48


class TinyPipeProposer(P.Proposer):
    """A proposer whose pipe holds a few kilobytes each way (the operating system's default holds hundreds)."""

    def _pipe(self, ctx):
        ends = super()._pipe(ctx)
        for end in ends:
            sock = socket.socket(fileno=end.fileno())
            try:
                for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    sock.setsockopt(socket.SOL_SOCKET, option, 2048)
            finally:
                sock.detach()  # the connection keeps its descriptor
        return ends


def _books(url: str) -> list:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.RDBStorage(url)
    books = []
    for i in range(STUDIES):
        problem = Problem("rms_norm", 16 + i, 96, "bf16")
        name = f"flood:{problem.key}"
        optuna.create_study(study_name=name, storage=storage)
        books.append(SimpleNamespace(name=name, problem=problem, space=Space(problem, INTERPRET_SM_COUNT),
                                     opts=SimpleNamespace(sampler="tpe", seed=0)))
    return books


def test_many_studies_wanted_at_once_never_block_the_worker(tmp_path):
    url = f"sqlite:///{tmp_path / 'flood.db'}"
    books = _books(url)
    proposer = TinyPipeProposer(url)
    try:
        proposer._start()
        deadline = time.monotonic() + 120
        while not proposer._answering and time.monotonic() < deadline:
            proposer._receive(1.0)
        assert proposer._answering, "the proposer process did not start"
        def want_each():  # one study after another, as a sweep's claims reach them: the process proposes between
            for book in books:
                proposer.take(book)
                time.sleep(0.05)

        wanted = threading.Thread(target=want_each, daemon=True)
        wanted.start()
        wanted.join(60)
        assert not wanted.is_alive(), "the worker blocked sending its requests"
        delivered = set()
        deadline = time.monotonic() + 120
        while len(delivered) < STUDIES and time.monotonic() < deadline:
            for book in books:
                if book.name not in delivered and proposer.take(book) is not None:
                    delivered.add(book.name)
        assert len(delivered) == STUDIES and not proposer._gone
    finally:
        proposer.close()
