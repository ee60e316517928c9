"""Stepping an in-process engine of a KV-connector test: a request to its end, and the check that
every block came back."""

from __future__ import annotations

import time


def run(engine, request):
    """(tokens, last output) of `request`, stepping `engine` until nothing is left."""
    engine.add_request(request)
    return finish(engine, request.request_id)


def finish(engine, request_id: str):
    """Step `engine` until nothing is left: (tokens, last output) of `request_id`."""
    tokens, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                last = out
    return tokens, last


def all_blocks_back(engine, wait_s: float = 10.0) -> bool:
    """Every block free, within `wait_s`: a producer's server thread hands a served hold back
    after its last send returns, which on a loaded box may come after the consumer has finished."""
    bm, deadline = engine.scheduler.block_manager, time.monotonic() + wait_s
    while True:
        engine.scheduler.schedule()  # frees what consumers read or what expired
        if bm.num_free_blocks == bm.num_blocks or time.monotonic() > deadline:
            return bm.num_free_blocks == bm.num_blocks
        time.sleep(0.01)
