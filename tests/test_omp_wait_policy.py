"""``import dynaquant`` before torch makes OpenMP's idle workers sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the
environment says otherwise (dynaquant/__init__.py's "Threads")."""

import os
import subprocess
import sys


def _policy_after(code: str, env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_passive_by_default():
    assert _policy_after("import dynaquant", None) == "PASSIVE"


def test_the_users_setting_is_kept():
    assert _policy_after("import dynaquant", "ACTIVE") == "ACTIVE"


def test_after_torch_nothing_is_set():
    assert _policy_after("import torch; import dynaquant", None) == "None"
