# The two commands of the README: `make demo` (the main job) and `make test`.
.PHONY: setup demo test

setup:
	@bash scripts/setup_env.sh

demo: setup
	.venv/bin/python -m selfspec.demo

# Two pytest-xdist workers: servers and multi-process trainings run one at a time on one of them
# (tests/conftest.py), the other modules on the other. TEST_WORKERS=0 runs everything in-process.
TEST_WORKERS ?= 2

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadgroup
