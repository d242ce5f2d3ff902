# Two commands set everything up on a fresh machine: `make run` and `make test`.
ROOT := $(CURDIR)
include project.env
export

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_STAMP := data/fashion-mnist/FashionMNIST/raw/t10k-labels-idx1-ubyte
DEBIAN_DATA := /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PROFILE ?= quick
MODEL ?= resnet18

.PHONY: run test setup data lint ui bench clean

run: setup data  ## train, test, register and promote a model on Fashion-MNIST
	$(PY) -m flows train --profile $(PROFILE) --model $(MODEL)

test: setup data  ## the fast test suite
	$(PY) -m pytest -q

setup: $(STAMP)

# Reinstalls only when pyproject.toml changes; pip keeps what is already satisfied (torch).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

data: setup $(DATA_STAMP)

$(DATA_STAMP):
	test -f $(DEBIAN_DATA) || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq dataset-fashion-mnist; }
	$(PY) -m flows prepare-data

lint: setup
	$(VENV)/bin/ruff check .

ui: setup  ## Prefect UI on 127.0.0.1:4200 and MLflow UI on 127.0.0.1:5000
	@echo "Prefect UI: http://127.0.0.1:4200   MLflow UI: http://127.0.0.1:5000   (Ctrl-C stops both)"
	trap 'kill 0' INT TERM EXIT; \
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200 & \
	$(VENV)/bin/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri "$(MLFLOW_TRACKING_URI)" & \
	wait

bench: setup data
	$(PY) bench/throughput.py

clean:
	rm -rf .prefect artifacts mlruns/mlflow.db mlruns/artifacts
