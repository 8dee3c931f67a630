# Two commands do all set-up:
#   make demo   create .venv, install, run the whole job on synthetic data with tiny encoders (Prefect embedded)
#   make test   create .venv, install, run the tests
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: an open range pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# torchaudio (ltx-core's dependency, in the test extra) second, the build that imports beside that torch:
	# PyPI's CUDA 13 build where it does, else that release without its compiled extension. A torchaudio that
	# does not load breaks diffusers and transformers in every process of the venv.
	$(BIN)/python -m diffprep.families.ltx2_torchaudio
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/diffprep demo --workdir demo

test: setup
	$(BIN)/python -m pytest

clean-demo:
	rm -rf demo
