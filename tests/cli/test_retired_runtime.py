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


def test_an_assignment_naming_the_stateful_runtime_is_refused_and_none_means_the_exports_runtime(tiny_export):
    """What the fleet service sends an agent: ``stateful`` is refused with the message (HTTP 400), an
    assignment without a runtime (an older service) gets the one the export's target calls for."""
    from engine.control.messages import Assignment, ControlRequestError
    from engine.shards.manifest import MANIFEST_NAME

    manifest_json = (tiny_export("llama", 1) / MANIFEST_NAME).read_text(encoding="utf-8")

    def assignment(**extra) -> dict:
        return Assignment.create(manifest_json, export_id="tiny", stage=0, source="https://hub/", listen_port=0,
                                 next_hop="127.0.0.1:9", **extra).to_dict()

    with pytest.raises(ControlRequestError, match=MESSAGE):
        Assignment.from_dict(assignment(runtime="stateful"))
    with pytest.raises(ControlRequestError, match="served by the paged runtime, not static"):
        Assignment.from_dict(assignment(runtime="static"))
    older = assignment()
    del older["runtime"]
    assert Assignment.from_dict(older).runtime == "paged"
