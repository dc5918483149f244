# The two commands that set everything up on a fresh machine (see README.md):
#   make demo   - install, fetch and verify the demo models, start the supervisor on the demo
#                 config (with its KServe v2 gateway), feed it frames from a producer in another
#                 process, send one request through tritonclient, show its status, stop it
#   make test   - install, fetch the models, lint, type-check and run the whole test suite
#   make bench  - the benchmark of README "Benchmarks" (installs Triton and Mosec into .bench/)
# Everything lives in .venv; the models in models/ (both ignored by git).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
IMAGES := tests/fixtures/images
SOCKET ?= /tmp/duomo-demo-$(shell id -u)/duomo.sock

.PHONY: demo test models lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[prepare,test,dev,bench]'
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/python tools/prepare_models.py

demo: models
	$(BIN)/duomo check -c configs/default.yaml
	$(BIN)/duomo start -c configs/default.yaml --socket $(SOCKET)
	$(BIN)/python tools/example_producer.py --socket $(SOCKET); status=$$?; \
	$(BIN)/python tools/example_v2_client.py || status=1; \
	$(BIN)/duomo infer --socket $(SOCKET) classify $(IMAGES)/chelsea.png; \
	$(BIN)/duomo status --socket $(SOCKET); \
	$(BIN)/duomo stop --socket $(SOCKET); exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: models lint
	$(BIN)/python -m pytest -q

bench: models
	$(BIN)/duomo bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) models .pytest_cache .mypy_cache .ruff_cache
