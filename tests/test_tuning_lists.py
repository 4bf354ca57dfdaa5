"""OOMB_TRITON_CONFIGS: tuning experiments replace the dense kernels' tile lists without a code change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from oomb.attention.triton_paged import tuning_lists_from_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_lists_parse():
    assert tuning_lists_from_env(None) == {} and tuning_lists_from_env("") == {}
    lists = tuning_lists_from_env('{"dkdv": [[32, 128, 8, 3], [64, 64, 8, 3]], "fwd": [[128, 128, 8, 2]]}')
    assert lists == {"dkdv": [(32, 128, 8, 3), (64, 64, 8, 3)], "fwd": [(128, 128, 8, 2)]}


@pytest.mark.parametrize("text, words", [
    ("{dkdv: 1}", "not JSON"),
    ('{"bwd": [[64, 64, 4, 3]]}', "fwd, dkdv, dq"),
    ('[[64, 64, 4, 3]]', "fwd, dkdv, dq"),
    ('{"dq": []}', "non-empty list"),
    ('{"dq": [[64, 64, 4]]}', "non-empty list"),
    ('{"dq": [64, 64, 4, 3]}', "non-empty list"),
    ('{"dq": [[64, 64, 4, 3.5]]}', "non-empty list"),
    ('{"dq": [[64, 48, 4, 3]]}', "powers of two"),
    ('{"dq": [[64, 64, 4, 0]]}', "stages >= 1"),
])
def test_bad_lists_are_refused_with_the_reason(text, words):
    with pytest.raises(ValueError, match=words):
        tuning_lists_from_env(text)


def test_the_variable_replaces_the_lists_at_import():
    """In a fresh process (the lists are read at import, like Triton's own environment) and without the
    interpreter (which tunes nothing: one small config)."""
    code = ("import json; from oomb.attention import triton_paged as t, triton_sparse as s; "
            "print(json.dumps([[c.kwargs['BLOCK_M'], c.kwargs['BLOCK_N'], c.num_warps, c.num_stages] "
            "for c in (t._DKDV_CONFIGS + t._FWD_CONFIGS + s._history_dkdv_kernel.configs)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OOMB_TRITON_CONFIGS"] = json.dumps({"dkdv": [[32, 128, 8, 3]]})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    dkdv, *forward, history = json.loads(done.stdout)
    assert dkdv == [32, 128, 8, 3] and history == [32, 128, 8, 3]  # the sparse kernels share the lists
    assert forward == [[128, 64, 4, 3], [128, 128, 8, 3], [128, 64, 8, 3]]  # unnamed lists stay as built
