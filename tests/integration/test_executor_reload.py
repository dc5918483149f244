"""A user's own executor class (``task: package.module:ClassName``) and ``duomo reload``: a real
supervisor serves the module's current code after a reload, for one model or the whole config."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from duomo.ipc.client import Client
from tests.integration.harness import SupervisorProcess, duomo, running_supervisor, write_config

X = np.array([[1, 2, 3, 4]], dtype=np.float32)
# y = 2x + OFFSET: which version of the module built the model that answered
SOURCE = """
import numpy as np

from tests.fakes.faulty_executor import FaultyExecutor

OFFSET = {offset}


class Shift(FaultyExecutor):
    def execute(self, items, timer):
        return [{{"y": 2 * x + np.float32(OFFSET)}} for x in items]
"""


def answer(sup: SupervisorProcess) -> float:
    with Client(sup.socket, timeout_s=30) as client:
        return float(client.model("shift").infer(X)["y"][0, 0])


def test_reload_serves_the_current_code_of_a_users_executor_module(tmp_path: Path) -> None:
    module = tmp_path / "user_shift_tasks.py"  # found in the config's folder
    module.write_text(SOURCE.format(offset="1.0"))
    entry = {"name": "shift", "task": "user_shift_tasks:Shift", "files": {}, "max_batch": 2}
    config = write_config(tmp_path, [], extra=[entry])
    with running_supervisor(config) as sup:
        assert answer(sup) == 3.0

        module.write_text(SOURCE.format(offset="5.0"))  # the same length, at once
        reloaded = duomo(sup.socket, "reload", "shift")
        assert reloaded.returncode == 0 and "replaced: shift" in reloaded.stdout, reloaded
        assert answer(sup) == 7.0

        module.write_text(SOURCE.format(offset="9.0"))  # the config itself is unchanged
        reloaded = duomo(sup.socket, "reload")
        assert reloaded.returncode == 0 and "replaced: shift" in reloaded.stdout, reloaded
        assert answer(sup) == 11.0
        unchanged = duomo(sup.socket, "reload")
        assert "nothing changed" in unchanged.stdout, unchanged

        module.write_text(SOURCE.format(offset="9.0 +"))  # a syntax error: refused, still served
        refused = duomo(sup.socket, "reload", "shift")
        assert refused.returncode == 2, refused
        assert "models[shift].task: cannot import executor module user_shift_tasks" in (
            refused.stderr
        )
        assert "SyntaxError" in refused.stderr
        assert answer(sup) == 11.0
