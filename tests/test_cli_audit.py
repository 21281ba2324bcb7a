"""A user's bad input, found in a fresh-eyes audit of the CLI and the stage API: each is a one-line
error (exit 2, no traceback) before any work is done."""

from __future__ import annotations

import pytest

from qosflow.cli.main import main


@pytest.mark.parametrize(
    "argv, says",
    [
        # numpy's SeedSequence and scikit-learn's random_state take 0 .. 2**32-1: a negative seed was a
        # "ValueError: expected non-negative integer" traceback (after the trace had loaded)
        (["simulate", "--jobs", "10", "--no-plots", "--policies", "fifo", "--seed", "-1"], "Invalid value for '--seed'"),
        (["pack", "--seeds", "1", "--seed", "-1"], "Invalid value for '--seed'"),
        (["predict", "eval", "--throughputs", "t.json", "--seed", "-1"], "Invalid value for '--seed'"),
        (["predict", "eval", "--throughputs", "t.json", "--seed", str(2**32)], "Invalid value for '--seed'"),
    ],
)
def test_a_seed_out_of_range_is_a_usage_error(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
