"""A mistake on the command line is one line on stderr, exit 2: the command's own name, what is
wrong (naming the KVROUTE_* variable when the value came from one), where the options are listed;
no usage block above it (kvservice/options.py, kvroute/cli)."""

from __future__ import annotations

import argparse

import pytest

from kvroute.cli import main
from kvservice.options import naming_the_variable


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (["router", "--bogus"], {}, "kvroute router: error: unrecognized arguments: --bogus"),
        (["index", "lookup", "--model", "m", "--tokens", "1", "--x"], {}, "kvroute index lookup: error: unrecognized"),
        (["router", "--max-body-bytes", "-5"], {}, "kvroute router: error: --max-body-bytes must be at least 1024"),
        (
            ["router"],
            {"KVROUTE_MAX_BODY_BYTES": "-5"},
            "kvroute router: error: KVROUTE_MAX_BODY_BYTES must be at least",
        ),
        (["sim-engine", "--num-blocks", "0"], {}, "kvroute sim-engine: error: --num-blocks"),
        (["nonsense"], {}, "kvroute: error: argument COMMAND: invalid choice: 'nonsense'"),
    ],
)
def test_a_mistake_is_one_line_naming_the_command_and_exit_2(argv, env, line, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith(line) and "usage:" not in err, err
    assert err.rstrip().endswith("--help lists the options)")


def test_the_variable_is_named_only_when_the_value_came_from_it():
    message = "--max-body-bytes must be at least 1024, got -5"
    env = {"KVROUTE_MAX_BODY_BYTES": "-5"}
    from_env = argparse.Namespace(max_body_bytes=None)
    assert naming_the_variable(message, from_env, env) == "KVROUTE_MAX_BODY_BYTES must be at least 1024, got -5"
    assert naming_the_variable(message, argparse.Namespace(max_body_bytes=-5), env) == message  # the flag won
    assert naming_the_variable(message, from_env, {}) == message
    assert naming_the_variable("no flag here", from_env, env) == "no flag here"


def test_a_sim_engine_variable_is_named_by_its_own_prefix():
    from kvservice.declared import variables_of
    from sim_engine.settings import SimEngineSettings

    variables = variables_of(SimEngineSettings)
    assert (
        variables["--num-blocks"] == "KVROUTE_SIM_NUM_BLOCKS"
        and variables["--max-running"] == "KVROUTE_SIM_MAX_NUM_SEQS"
    )
    assert variables["--log-level"] == "KVROUTE_LOG_LEVEL"  # logging's are every command's
    message = "--num-blocks must be >= 2 (block 0 is the null block), got 1"
    env = {"KVROUTE_SIM_NUM_BLOCKS": "1"}
    named = naming_the_variable(message, argparse.Namespace(num_blocks=None), env, variables)
    assert named == "KVROUTE_SIM_NUM_BLOCKS must be >= 2 (block 0 is the null block), got 1"
