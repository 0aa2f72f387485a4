# Shortcuts for the two README commands.
.PHONY: demo test bench

demo:
	python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/grpo-cli analyze sample_data/rollouts.parquet

test:
	bash .ci/run

bench:
	python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/python bench/run.py
