"""`kvgate engine --headless` refuses what cannot make a node, before it dials anything: node rank 0
(the engine is `kvgate serve`), a rank outside 1..nnodes-1, no shared secret or a short one."""

from __future__ import annotations

import pytest

from gateway.cli import main

BASE = ["engine", "--headless", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "1"]


@pytest.mark.parametrize("args, secret, message", [
    (["--node-rank", "0"], "x" * 16, "node 0 is the engine itself: run `kvgate serve`"),
    (["--node-rank", "2"], "x" * 16, "--node-rank 2 is not one of 1..1"),
    (["--node-rank", "1"], None, "needs a shared secret: set KVGATE_RENDEZVOUS_SECRET"),
    (["--node-rank", "1"], "short", "the rendezvous secret in $KVGATE_RENDEZVOUS_SECRET is 5 bytes; at least 16"),
])
def test_what_cannot_make_a_node_is_refused_with_the_reason(args, secret, message, monkeypatch, capsys):
    monkeypatch.delenv("KVGATE_RENDEZVOUS_SECRET", raising=False)
    if secret is not None:
        monkeypatch.setenv("KVGATE_RENDEZVOUS_SECRET", secret)
    assert main(BASE + args) == 2
    assert message in capsys.readouterr().err


def test_a_missing_secret_file_is_named(tmp_path, capsys):
    assert main(BASE + ["--node-rank", "1", "--rendezvous-secret-file", str(tmp_path / "nope")]) == 2
    assert f"rendezvous secret file {tmp_path / 'nope'}: No such file or directory" in capsys.readouterr().err
