# The two commands of the quick start: `make run` and `make test`. Both set up first; the
# setup is idempotent and takes a second when there is nothing left to do.
VENV    := .venv
PYTHON  := $(VENV)/bin/python
CONFIG  ?=

.PHONY: setup run test bench clean

setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/loadmesh agent $(if $(CONFIG),--config $(CONFIG))

test: setup
	$(PYTHON) -m pytest

bench:
	bash scripts/setup.sh --bench
	$(PYTHON) scripts/bench_probes.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
