"""Checks on a whole engine (make_engine_core: the core and its output processor) that several engine tests share."""

from __future__ import annotations

from native_backend.core.interface import EngineRequest


def assert_abort_frees_every_block(engine, prompt: list[int], sampling) -> None:
    """A request aborted mid-generation is gone within one step, and with it every block."""
    engine.add_request(EngineRequest("gone", prompt, sampling))
    engine.step()
    engine.step()
    engine.abort("gone")
    engine.step()
    assert not engine.has_unfinished()
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.plan.num_blocks
