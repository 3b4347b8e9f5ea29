# locomesh: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test-deps demo test test-slow bench mutate clean docker-base docker-wheelhouse docker-images docker-smoke
# make bench SCALE=full OUT=DIR: command-line values win; a SCALE or OUT in the environment does not
SCALE = quick
OUT = benchmarks/results

# KEEP_TORCH=1: keep the torch that PYTHON already has (a CUDA build, say) when it is in the tested range
# (pyproject.toml): the venv sees PYTHON's packages and only torch's pin is left out.
KEEP_TORCH ?=
CONSTRAINTS := $(if $(KEEP_TORCH),$(VENV)/constraints-keep-torch.txt,constraints.txt)

setup: $(STAMP)

# Re-installs only when the dependency pins change; an up-to-date venv costs nothing.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(if $(KEEP_TORCH),--system-site-packages) $(VENV)
	$(if $(KEEP_TORCH),grep -v '^torch==' constraints.txt > $(CONSTRAINTS))
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev,lite]'
	$(PY) -c "import hivemind, torch, node, protocol, compression, gossip, swarm; print('locomesh ready: torch', torch.__version__, 'hivemind', hivemind.__version__)"
	$(PY) -c "import libp2p, protocol.libp2p_transport; print('light client ready: libp2p', libp2p.__version__)"  # its own process: libp2p and hivemind cannot share one
	touch $(STAMP)

# A local swarm of 3 daemons on loopback training on the embedded corpus.
demo: setup
	$(VENV)/bin/node swarm --nodes 3 --duration 150 --report runs/demo/report.json --checkpoint-dir runs/demo

# Debian's prometheus for the real-scrape test and iptables for the NAT tests (routers in network
# namespaces); installed where apt-get runs as root, else those tests skip with a one-line reason.
test-deps:
	@for pkg in prometheus iptables; do \
	  command -v $$pkg >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && { \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1; }; }; } \
	  || echo "note: $$pkg is not installed; the tests that need it will skip"; \
	done

# The live tests mostly wait (daemon start-up, rounds, timeouts), so pytest-xdist runs TEST_WORKERS of them
# at once on any number of cores, longest first (tests/conftest.py); docs/testing.md has the details.
TEST_WORKERS ?= 4

test: setup test-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-slow: setup test-deps
	$(PY) -m pytest -q -m slow

# Every benchmark the docs quote (benchmarks/suite.py): SCALE=quick fits about 45 minutes on 2 cores,
# SCALE=full runs the docs' settings for hours; each writes OUT/NAME.json with a meta record. Entries that
# need root (network namespaces) skip with a one-line reason otherwise. Not part of `test`. Into the
# default OUT, the tables of docs/ are then regenerated from the files (python -m benchmarks.tables).
bench: setup
	$(PY) -m benchmarks.suite --scale $(SCALE) --out $(OUT); rc=$$?; \
	  if [ "$(OUT)" = benchmarks/results ]; then $(PY) -m benchmarks.tables || rc=1; fi; exit $$rc

# Mutation testing of the math modules (tests/mutate.py; settings in pyproject's [tool.mutmut]):
# ~2,800 mutants, writes benchmarks/results/mutation.json. Not part of `test`: it takes tens of minutes.
mutate: setup
	$(PY) -m pip install --quiet -c constraints.txt -e '.[mutate]'
	$(PY) -m tests.mutate

# Docker (docs/operations.md "Docker"): docker/build.sh makes the debootstrapped base image, the wheelhouse and
# the images, each cached; docker-smoke runs a compose swarm for a few minutes (slow, root, not in `test`).
docker-base:
	docker/build.sh base

docker-wheelhouse: setup
	PYTHON=$(PY) docker/build.sh wheelhouse

docker-images: setup
	PYTHON=$(PY) docker/build.sh

docker-smoke: setup
	PYTHON=$(PY) docker/smoke.sh

clean:
	rm -rf $(VENV) runs build *.egg-info
