"""The stateful serving runtime was retired: every command line that could ask for it (`deskfleet
serve --runtime stateful`, `deskfleet worker --runtime stateful`, `deskfleet fleet --runtime
stateful`) exits with one line naming the change and what serves instead, not an argparse crash
or a traceback; nothing is loaded first."""

from __future__ import annotations

import pytest

from tests.cli.test_cli import deskfleet

MESSAGE = "the stateful runtime was retired; paged serves CPU/GPU, static the NPU"


@pytest.mark.parametrize("argv", [
    ("serve", "--shards", "no-such-export", "--runtime", "stateful"),
    ("worker", "--shard", "no-such-export", "--next", "127.0.0.1:9", "--runtime", "stateful"),
    ("fleet", "--runtime", "stateful", "--state-dir", "no-such-dir"),
], ids=lambda argv: argv[0])
def test_asking_for_the_stateful_runtime_names_the_change(argv):
    result = deskfleet(*argv, timeout=120)
    assert result.returncode == 1, result.stderr
    assert MESSAGE in result.stderr
    assert "Traceback" not in result.stderr and "invalid choice" not in result.stderr
