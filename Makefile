# The two commands a newcomer needs (see README): `make run` and `make test`. Each sets up .venv first
# (scripts/setup.sh: it says what it installs, and installs nothing while setup.sh and pyproject.toml
# are unchanged).
PY := .venv/bin/python
PORT ?= 8000
PROMPT ?= Write a haiku about speculative decoding.
# pytest-xdist workers for the CPU suite: its compile-heavy tests leave the second core mostly idle
TEST_JOBS ?= 2

.PHONY: setup run chat test test-gpu

setup:
	bash scripts/setup.sh

run: setup
	$(PY) -m dspark.serve --port $(PORT)

chat: setup
	$(PY) -m dspark.generate --chat --prompt "$(PROMPT)"

test:
	bash scripts/setup.sh --test
	$(PY) -m pytest tests --ignore=tests/interpret -q -n $(TEST_JOBS) --durations=10
	TRITON_INTERPRET=1 $(PY) -m pytest tests/interpret -q -n $(TEST_JOBS) --durations=5

test-gpu:
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'test-gpu needs a CUDA device')"
	$(PY) -m pytest tests -m gpu -q
