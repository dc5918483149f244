# The two commands that set everything up on a fresh machine (see README.md):
#   make demo   - install, fetch and verify the demo models, run them on the fixture images
#   make test   - install, fetch the models, lint, type-check and run the whole test suite
# Everything lives in .venv; the models in models/ (both ignored by git).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
IMAGES := tests/fixtures/images

.PHONY: demo test models lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[prepare,test,dev]'
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/python tools/prepare_models.py

demo: models
	$(BIN)/duomo check -c configs/default.yaml
	$(BIN)/duomo infer -c configs/default.yaml classify $(IMAGES)/coffee.png $(IMAGES)/chelsea.png
	$(BIN)/duomo infer -c configs/default.yaml face $(IMAGES)/astronaut.png
	$(BIN)/duomo infer -c configs/default.yaml ocr $(IMAGES)/page.png

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: models lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) models .pytest_cache .mypy_cache .ruff_cache
