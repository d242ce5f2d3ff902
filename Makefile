# Two commands set everything up on a fresh machine: `make run` and `make test`.
ROOT := $(CURDIR)
include project.env
export $(shell sed -n 's/^\([A-Z_][A-Z0-9_]*\) *?=.*/\1/p' project.env)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEBIAN_DATA := /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz
DEBIAN_WORDNET := /usr/share/wordnet/data.noun  # image_text: class descriptions
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PROFILE ?= quick

.PHONY: run test setup data browser lint ui bench gpu-check deploy worker serve clean

run: setup data  ## the retraining pipeline on Fashion-MNIST: train, test, register, promote
	$(PY) -m flows pipeline --profile $(PROFILE)

# Two pytest workers, one thread each (the tests' models are tiny: a second thread per worker only
# contends), a test file's tests on one worker (its module fixtures run once), the longest files
# first (tests/conftest.py, LONGEST_FIRST).
TEST_WORKERS ?= 2
test: setup data browser  ## the fast test suite
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

setup: $(STAMP)

# Reinstalls only when pyproject.toml changes; pip keeps what is already satisfied (torch).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

# Cheap when done before: unpacks only missing files; dvc add and push are then no-ops.
data: setup
	test -f $(DEBIAN_DATA) -a -f $(DEBIAN_WORDNET) || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq dataset-fashion-mnist \
	  wordnet-base; }
	$(PY) -m flows prepare-data

# The deployment test opens the Prefect and MLflow pages in headless Chromium (Debian's).
browser:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

lint: setup
	$(VENV)/bin/ruff check .

# Exit status 0 when nothing answers on 127.0.0.1:PORT.
PORT_FREE := $(PY) -c 'import socket, sys; sys.exit(socket.socket().connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0)'

# A UI already answering on its port is left alone; Ctrl-C stops only the servers started here.
ui: setup  ## Prefect UI on 127.0.0.1:4200 and MLflow UI on 127.0.0.1:5000
	@echo "Prefect UI: http://127.0.0.1:4200   MLflow UI: http://127.0.0.1:5000   (Ctrl-C stops both)"
	@pids=; trap 'kill $$pids 2>/dev/null' INT TERM EXIT; \
	if $(PORT_FREE) 4200; then $(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200 & \
	  pids="$$pids $$!"; else echo "the Prefect UI is already running at http://127.0.0.1:4200"; fi; \
	if $(PORT_FREE) 5000; then $(VENV)/bin/mlflow ui --host 127.0.0.1 --port 5000 \
	  --backend-store-uri "$(MLFLOW_TRACKING_URI)" --default-artifact-root "file://$(ROOT)/mlruns/artifacts" \
	  & pids="$$pids $$!"; \
	else echo "the MLflow UI is already running at http://127.0.0.1:5000"; fi; \
	wait

bench: setup data  ## the benchmarks (tables, then one JSON line each)
	$(PY) -m bench.throughput
	$(PY) -m bench.inference_batch
	$(PY) -m bench.train_accuracy
	$(PY) -m bench.distill_targets
	$(PY) -m bench.pbt
	$(PY) -m bench.small_data
	$(PY) -m bench.sparsify
	$(PY) -m bench.cascade
	$(PY) -m bench.image_text
	$(PY) -m bench.pipeline
	$(PY) -m bench.serving

gpu-check: setup data  ## every flow on CUDA (DDP, Dask, throughput); one line and exit 0 without a GPU
	$(PY) -m bench.gpu_check

deploy: setup  ## register prefect.yaml's deployments with the server at PREFECT_API_URL
	$(VENV)/bin/prefect work-pool create local --type process --overwrite
	$(VENV)/bin/prefect --no-prompt deploy --all

# Each run executes in a fresh clone of the deployed commit (prefect.yaml's pull step); its data,
# artifacts, DVC remote, MLflow store and Prefect results stay where this folder's project.env
# puts them unless the environment names shared ones (docs/usage.md, Prefect deployments).
worker: export COMPACTML_DATA_DIR ?= $(ROOT)/data
worker: export COMPACTML_ARTIFACTS ?= $(ROOT)/artifacts
worker: setup  ## a process worker that runs deployments from the `local` pool
	COMPACTML_DVC_REMOTE="$${COMPACTML_DVC_REMOTE:-$$($(PY) -c 'from tasks.adapters.versioning import project_remote_url; print(project_remote_url())')}" \
	  $(VENV)/bin/prefect worker start --pool local

# NAME as the MLflow UI shows it; none: what `make run` registers (tasks.configs.sections.model_name_of).
serve: setup  ## serve NAME's champion on 127.0.0.1:5001, following the alias (NAME=compactml-pipeline by default)
	name=$$($(PY) -c 'import sys; from tasks.configs.sections import model_name_of; print(model_name_of(None, sys.argv[1] or None, "pipeline"))' \
	  "$(NAME)") && \
	$(PY) -m flows serve "$$name" --host 127.0.0.1 --port 5001

clean:
	rm -rf .prefect artifacts mlruns/mlflow.db mlruns/artifacts
