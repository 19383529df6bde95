"""One exit-status mapping for the CLI and the launchers (``moonep_sim.errors.exit_status``)."""

from __future__ import annotations

import pytest

from moonep_sim import cli
from moonep_sim.errors import CommError, ConfigError, exit_status


def _raise(exc):
    def fn(*_a, **_k):
        raise exc
    return fn


@pytest.mark.parametrize("exc, status, line", [
    (CommError("dispatch.0 all_to_all failed after 5.0 s on rank 1 (silent peer rank 0)"), 1, "silent peer rank 0"),
    (ConfigError("--ranks (3) must divide the experts (8)"), 2, "--ranks (3)"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_cli_and_launchers_share_one_mapping(monkeypatch, capsys, exc, status, line):
    assert exit_status(_raise(exc)) == status
    first = capsys.readouterr().err.strip().splitlines()
    assert len(first) == 1 and line in first[0]
    # the CLI's main: a command whose body raises the same error exits with the same status
    parser = cli.build_parser()
    args = parser.parse_args(["strategies"])
    monkeypatch.setattr(cli, "build_parser", lambda: _Fixed(args, _raise(exc)))
    assert cli.main(["strategies"]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err == first


def test_a_command_returns_its_own_status():
    assert exit_status(lambda: None) == 0 and exit_status(lambda: 3) == 3


class _Fixed:
    """A parser stand-in returning parsed args whose command body is ``func``."""

    def __init__(self, args, func):
        self.args, self.func = args, func

    def parse_args(self, _argv):
        self.args.func = self.func
        return self.args

    def print_help(self):  # pragma: no cover - not reached
        pass
