# The two commands of the README: `make demo` (the main job) and `make test`.
.PHONY: setup demo test

setup:
	@bash scripts/setup_env.sh

demo: setup
	.venv/bin/python -m selfspec.demo

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15
