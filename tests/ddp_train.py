"""Run one training objective from a JSON spec ({"objective": name, "config": {field: value}})
under `accelerate launch` (tests/test_training_ddp.py): the loop exactly as `selfspec train`
runs it, for objectives whose command-line recipe needs more set-up than a test wants."""

import json
import sys
from pathlib import Path

from selfspec.training.loop import train
from selfspec.training.objective import objective_class

spec = json.loads(Path(sys.argv[1]).read_text())
cls = objective_class(spec["objective"])
train(cls(cls.config_class(**spec["config"])))
