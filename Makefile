# Everyday commands; CI runs .ci/run (fresh environments, both transformers majors).
.PHONY: install test lint format smoke env
install:
	pip install torch==2.13.0 && pip install -e ".[dev]"
test:
	pytest
lint:
	ruff check . && ruff format --check .
format:
	ruff check --fix . && ruff format .
smoke:
	python train.py recipe=bert_squad debug=smoke
env:
	python -m recipes.env
