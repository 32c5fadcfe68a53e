"""How OpenMP threads wait: the default, a caller's own choice, and what a benchmark worker gets."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from linnet.openmp import describe, policy_environment, set_default_policy


def test_the_default_is_a_brief_spin_unless_the_caller_chose():
    env: dict[str, str] = {}
    set_default_policy(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        set_default_policy(env)
        assert env == chosen


def test_a_policy_replaces_every_inherited_setting():
    inherited = {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}
    assert policy_environment(inherited, "passive") == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert policy_environment(inherited, "inherit") == inherited
    assert describe(policy_environment({}, "brief")) == "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000"
    assert describe({}) == "OMP_WAIT_POLICY unset"
    with pytest.raises(ValueError, match="unknown OpenMP wait policy 'lazy'"):
        policy_environment({}, "lazy")


def test_the_command_sets_the_default_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import os, sys, linnet.openmp; assert 'torch' not in sys.modules; import linnet.cli; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "1000"]
