"""Misuse of the command line is one line naming the flag, never a traceback."""

from __future__ import annotations

import pytest

from jaxoverlap.__main__ import main


@pytest.mark.parametrize("args, named", [
    (["--scale", "0"], "argument --scale: must be an integer >= 1, got 0"),
    (["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
    (["--tp", "two"], "argument --tp: invalid integer value: 'two'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--impls", "xla", "fast"], "argument --impls: invalid choice: 'fast'"),
])
def test_bench_argument_errors_name_the_flag(capsys, args, named):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *args])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_unknown_preset_names_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", "h1000"])
    message = str(exit_.value.code)
    assert message.startswith("bench: --model h1000: preset 'h1000': not a built-in")
    assert "h100" in message       # the known presets are listed
