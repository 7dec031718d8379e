# The two commands of the quick start: `make run` and `make test`. Both set up first; the
# setup is idempotent and takes a second when there is nothing left to do.
VENV    := .venv
PYTHON  := $(VENV)/bin/python
CONFIG  ?=

.PHONY: setup run test bench bench-probe-steps bench-probes-ab bench-vllm bench-fleet bench-agent-cpu clean

setup:
	bash scripts/setup.sh

# Without CONFIG: a one-node mesh on this host, with a gossip key made on the first run
# (an open mesh needs gossip.insecure = true: docs/gossip.md, Security).
DEV_CONFIG := $(VENV)/loadmesh-dev.toml

run: setup
	@[ -e $(VENV)/gossip.key ] || (umask 077; $(PYTHON) -c 'import secrets; print(secrets.token_hex(32))' > $(VENV)/gossip.key)
	@[ -e $(DEV_CONFIG) ] || printf '[gossip]\nkey_file = "%s"\n' "$(abspath $(VENV))/gossip.key" > $(DEV_CONFIG)
	$(VENV)/bin/loadmesh agent --config $(or $(CONFIG),$(DEV_CONFIG))

# Three workers, each module whole on one (tests/conftest.py orders them): the suite mostly
# waits on agents, namespaces and timers, so on two CPUs it takes 2.5 min where one worker
# took 6.5; a fourth gained nothing and made the timing checks each other's noise.
test: setup
	$(PYTHON) -m pytest -n 3 --dist loadscope

bench:
	bash scripts/setup.sh --bench
	$(PYTHON) scripts/bench_probes.py

# The probes' kernel time per kind of segment, by BPF_PROG_TEST_RUN: no network stack, so
# steady enough to weigh a change to the C probes (seconds, no tools beyond setup).
bench-probe-steps: setup
	$(PYTHON) scripts/bench_probe_steps.py

# The probes' kernel time per request under real load, this tree's against BASELINE's (a git
# revision of the same map layout), attached in turns: `make bench-probes-ab BASELINE=HEAD~1`.
bench-probes-ab:
	bash scripts/setup.sh --bench
	$(PYTHON) scripts/bench_probes_ab.py --baseline $(BASELINE)

# A real vLLM on this CPU, loaded until it queues: loadmesh's figures beside vLLM's own and
# the clients'. The first run installs vLLM into /var/tmp/loadmesh-vllm (minutes, 3.5 GB).
bench-vllm: setup
	$(PYTHON) scripts/bench_vllm.py

# Five hosts in namespaces, a loadmesh agent on each, the same arrivals routed by loadmesh,
# round robin, random, a JSQ oracle and sglang-router (installed into /var/tmp/loadmesh-sglang
# on the first run); then a slowdown, and sessions with a host killed. About 25 minutes.
bench-fleet: setup
	$(PYTHON) scripts/bench_fleet.py --slowdown --sessions 300

# One real agent among 999 peers: the simulator records what one node of a 1000-node mesh
# receives, and the recording is replayed to the agent on real UDP. About 12 minutes, most
# of it the simulation.
bench-agent-cpu:
	bash scripts/setup.sh --bench
	$(PYTHON) scripts/bench_agent_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
